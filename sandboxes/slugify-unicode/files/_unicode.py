"""Transliteration of Unicode text to plain ASCII."""

import unicodedata

# Letters that NFKD does not decompose into an ASCII base letter.
_SPECIAL = str.maketrans({
    "\u00c6": "AE", "\u00e6": "ae",  # AE ligature
    "\u0152": "OE", "\u0153": "oe",  # OE ligature
    "\u00d8": "O", "\u00f8": "o",  # O with stroke
    "\u0141": "L", "\u0142": "l",  # L with stroke
    "\u00d0": "D", "\u00f0": "d",  # eth
    "\u00de": "TH", "\u00fe": "th",  # thorn
    "\u00df": "ss",  # sharp s
})


def to_ascii(text: str) -> str:
    """Return *text* transliterated to ASCII.

    Accented letters lose their accents, compatibility characters (such as
    full-width letters) are folded to their plain form, a few letters
    without a decomposition are spelled out, anything else is dropped.

    >>> to_ascii("Cr\u00e8me Br\u00fbl\u00e9e")
    'Creme Brulee'
    """
    text = unicodedata.normalize("NFKD", text.translate(_SPECIAL))
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return text.encode("ascii", "ignore").decode("ascii")
