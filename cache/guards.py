"""Cheap lexical checks that two prompts ask different questions, whatever their embeddings say.

Sentence embeddings place "enable X" next to "disable X" and "convert A to B" next to "convert B to A"; these rules
read the words instead. Each returns the reason, or None. A pair caught here scores 0 in the verifiers, so no bound
and no learned threshold serves it (tests/data/cache_hard_negatives.jsonl: 265 such pairs, all missed).
"""
from __future__ import annotations

import re

from cache.features import NEGATIONS, STOPWORDS, numbers, words

_PAIRED = [("enable", "disable"), ("on", "off"), ("start", "stop"), ("add", "remove"), ("show", "hide"),
           ("increase", "decrease"), ("upload", "download"), ("import", "export"), ("allow", "block"),
           ("buy", "sell"), ("before", "after"), ("max", "min"), ("maximum", "minimum"), ("open", "close"),
           ("good", "bad"), ("more", "less"), ("best", "worst"), ("input", "output"), ("push", "pull"),
           ("send", "receive"), ("win", "lose"), ("gain", "lose"), ("positive", "negative"), ("high", "low"),
           ("higher", "lower"), ("first", "last"), ("join", "leave"), ("accept", "reject"), ("pros", "cons"),
           ("advantages", "disadvantages"), ("legal", "illegal"), ("above", "below"), ("inside", "outside"),
           ("encrypt", "decrypt"), ("encode", "decode"), ("encryption", "decryption"), ("in", "out")]
OPPOSITES = {a: b for a, b in _PAIRED} | {b: a for a, b in _PAIRED}
_NEGATING_PREFIXES = ("un", "dis", "de", "in", "im", "il", "ir", "non")
DIRECTION_WORDS = frozenset("to into from than towards onto".split())
_CURRENCY_CODES = frozenset("usd eur gbp jpy inr cny rmb cad aud chf nzd sgd hkd krw rub brl mxn btc eth".split())
UNITS = _CURRENCY_CODES | frozenset("""mm cm m km meter meters metre metres kilometer kilometers kilometre kilometres mile miles inch inches
    foot feet yard yards mg g gram grams kg kilogram kilograms pound pounds lb lbs ounce ounces oz ton tons tonne tonnes
    ml l liter liters litre litres gallon gallons pint pints quart quarts cup cups teaspoon teaspoons tablespoon
    tablespoons second seconds minute minutes hour hours day days week weeks month months year years decade decades
    kb mb gb tb kbps mbps gbps w kw mw watt watts kilowatt kilowatts volt volts amp amps hz khz mhz ghz celsius
    fahrenheit kelvin percent mph kph calories kcal joules dollars euros pounds yen rupees
    mi ft yd gal gals c f k""".split())
_CURRENCY_SIGNS = {"$": " usd ", "€": " eur ", "£": " gbp ", "¥": " jpy ", "₹": " inr "}  # words() drops the signs
_ONE = frozenset("a an one per each every".split())  # "a mile", "per hour": a quantity without a number
TIMES = frozenset("""january february march april may june july august september october november december jan feb mar
    apr jun jul aug sep sept oct nov dec monday tuesday wednesday thursday friday saturday sunday today tonight
    tomorrow yesterday morning afternoon evening night weekend weekday spring summer autumn fall winter""".split())
_LANGUAGE_WORDS = {
    "en": set("the is are what how why which who do does can i you my of and to in for with".split()),
    "es": set("el la los las es qué cómo por cuál de y en para con mi tu un una".split()),
    "fr": set("le la les est quels quelle comment pourquoi de et en pour avec mon ton un une du des".split()),
    "de": set("der die das ist was wie warum welche ich du mein und mit für ein eine den des".split()),
    "it": set("il lo la gli è che come perché quale di e per con mio un una del della".split()),
    "pt": set("o os as é que como por qual de e em para com meu um uma do da".split()),
}
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9'’]*")
_TITLES = frozenset("mr mrs ms dr prof sir madam shri smt".split())
_NOT_NAMES = STOPWORDS | _TITLES
_ENDINGS = ("s", "es", "n", "an", "ns", "ans")  # "IITs", "Indian", "Germans": the same name with another ending


def language_of(text: str) -> str | None:
    tokens = re.findall(r"[^\W\d_]+", text.lower())
    counts = {lang: sum(t in vocab for t in tokens) for lang, vocab in _LANGUAGE_WORDS.items()}
    best = max(counts, key=counts.__getitem__)
    return best if counts[best] >= 2 else None


def _negated(ws: list[str]) -> bool:
    return any(w in NEGATIONS or w.endswith("n't") for w in ws)


def _opposite(sa: set[str], sb: set[str]) -> bool:
    """A word on one side only whose opposite is on the other ("turn on" / "turn off": "on" may be on both)."""
    only_a, only_b = sa - sb, sb - sa
    if any(OPPOSITES.get(x) in sb for x in only_a) or any(OPPOSITES.get(y) in sa for y in only_b):
        return True
    for x in only_a:
        for y in only_b:
            longer, shorter = (x, y) if len(x) > len(y) else (y, x)
            if any(longer == p + shorter for p in _NEGATING_PREFIXES):
                return True
    return False


def _bare(word: str) -> str:
    word = word.lower().replace("’", "'")
    return word[:-2] if word.endswith("'s") else word.rstrip("'")


def _names(text: str) -> list[str]:
    """The capitalised words that are not a sentence's first word, a title ("Mr.") or a common word ("What", "If"),
    bare of possessives: the names a prompt mentions."""
    names, previous, previous_end = [], None, 0
    for m in _TOKEN.finditer(text):
        word = _bare(m.group())
        starts_sentence = previous is None or (
            any(c in text[previous_end:m.start()] for c in ".?!") and previous not in _TITLES)
        if m.group()[0].isupper() and not starts_sentence and len(word) > 1 and word not in _NOT_NAMES:
            names.append(word)
        previous, previous_end = word, m.end()
    return names


def _unmentioned(names: list[str], other: str) -> list[str]:
    """The names the other prompt never says, in any case, possessive or not, or with one of _ENDINGS more or less
    ("IIT" / "IITs", "India" / "Indian"; "Niger" / "Nigeria" stay apart)."""
    said = {_bare(w) for w in _TOKEN.findall(other)}
    return [name for name in names if name not in said and not any(
        name + e in said or (name.endswith(e) and len(name) - len(e) >= 3 and name[:-len(e)] in said)
        for e in _ENDINGS)]


def different_question(a: str, b: str) -> str | None:
    """Why `a` and `b` cannot ask the same question, or None when the words allow it."""
    if numbers(a) != numbers(b):
        return "numbers"
    wa, wb = words(_signs_spelled(a)), words(_signs_spelled(b))
    sa, sb = set(wa), set(wb)
    if _negated(wa) != _negated(wb):
        return "negation"
    if _opposite(sa, sb):
        return "opposite"
    if (sa & UNITS) != (sb & UNITS):
        return "units"
    if (sa & TIMES) != (sb & TIMES):
        return "dates"
    la, lb = language_of(a), language_of(b)
    if la and lb and la != lb:
        return "language"
    if _unmentioned(_names(a), b) or _unmentioned(_names(b), a):  # a name on one side that the other never says
        return "entities"
    ca = [w for w in wa if w not in STOPWORDS or w in DIRECTION_WORDS]
    cb = [w for w in wb if w not in STOPWORDS or w in DIRECTION_WORDS]
    if sorted(ca) == sorted(cb) and ca != cb and DIRECTION_WORDS & set(ca):
        return "swapped roles"
    if len(sa & UNITS) > 1 and _measured(wa) != _measured(wb):  # "how many miles is 7 km" / "... km is 7 miles"
        return "swapped roles"
    return None


def _signs_spelled(text: str) -> str:
    for sign, code in _CURRENCY_SIGNS.items():
        text = text.replace(sign, code)
    return text


def _measured(ws: list[str]) -> list[str]:
    """The units quantities are given in ("7 km", "a mile", "$30", "CAD 30"), which the other units are asked in."""
    after = [u for q, u in zip(ws, ws[1:]) if u in UNITS and (q[0].isdigit() or q in _ONE)]
    before = [u for u, q in zip(ws, ws[1:]) if u in _CURRENCY_CODES and q[0].isdigit()]
    return sorted(after + before)
