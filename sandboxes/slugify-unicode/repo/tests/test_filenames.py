from textkit import safe_filename


def test_keeps_safe_names():
    assert safe_filename("report-2024.final.pdf") == "report-2024.final.pdf"


def test_replaces_unsafe_runs():
    assert safe_filename("my file (1).txt") == "my_file_1_.txt"


def test_no_hidden_files():
    assert safe_filename("..secret") == "secret"


def test_accented_name_is_transliterated():
    assert safe_filename("Résumé Zoë.pdf") == "Resume_Zoe.pdf"
