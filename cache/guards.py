"""Cheap lexical checks that two prompts ask different questions, whatever their embeddings say.

Sentence embeddings place "enable X" next to "disable X" and "convert A to B" next to "convert B to A"; these rules
read the words instead. Each returns the reason, or None. A pair caught here scores 0 in the verifiers, so no bound
and no learned threshold serves it (tests/data/cache_hard_negatives.jsonl: 240 such pairs, all missed).
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
UNITS = frozenset("""mm cm m km meter meters metre metres kilometer kilometers kilometre kilometres mile miles inch inches
    foot feet yard yards mg g gram grams kg kilogram kilograms pound pounds lb lbs ounce ounces oz ton tons tonne tonnes
    ml l liter liters litre litres gallon gallons pint pints quart quarts cup cups teaspoon teaspoons tablespoon
    tablespoons second seconds minute minutes hour hours day days week weeks month months year years decade decades
    kb mb gb tb kbps mbps gbps w kw mw watt watts kilowatt kilowatts volt volts amp amps hz khz mhz ghz celsius
    fahrenheit kelvin percent mph kph calories kcal joules dollars euros pounds yen rupees""".split())
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
_CAPITAL = re.compile(r"\b[A-Z][a-zA-Z0-9]+\b")


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


def _entities(text: str) -> set[str]:
    found = _CAPITAL.findall(text)
    first = text.split(maxsplit=1)[0] if text.strip() else ""
    return {w.lower() for w in found if w != first}


def different_question(a: str, b: str) -> str | None:
    """Why `a` and `b` cannot ask the same question, or None when the words allow it."""
    if numbers(a) != numbers(b):
        return "numbers"
    wa, wb = words(a), words(b)
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
    ea, eb = _entities(a), _entities(b)
    if (ea - sb) or (eb - sa):  # a name on one side that the other never mentions, in any case
        return "entities"
    ca = [w for w in wa if w not in STOPWORDS or w in DIRECTION_WORDS]
    cb = [w for w in wb if w not in STOPWORDS or w in DIRECTION_WORDS]
    if sorted(ca) == sorted(cb) and ca != cb and DIRECTION_WORDS & set(ca):
        return "swapped roles"
    return None
