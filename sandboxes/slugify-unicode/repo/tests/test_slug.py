from textkit import slugify


def test_basic():
    assert slugify("Hello, World!") == "hello-world"


def test_collapses_separators():
    assert slugify("  a -- b __ c  ") == "a-b-c"


def test_custom_separator():
    assert slugify("Release Notes 2024", separator="_") == "release_notes_2024"


def test_accents_are_transliterated():
    assert slugify("Café Crème Brûlée") == "cafe-creme-brulee"


def test_ligatures_and_fullwidth():
    assert slugify("Œuvre ＡＢＣ") == "oeuvre-abc"
