"""The lexical guards (cache/guards.py) read names as names: the same one written another way ("INDIA", "India's",
"IITs", after "Mr.") is no reason to miss, a name only one prompt says is; capitalised common words and the first
word of each sentence are not names. A conversion asked the other way round is another question however it is
worded ("how many miles is 7 km"), a conversion asked in other words is not."""
import pytest

from cache.guards import different_question

SAME_NAMES = [
    ("What will be Hillary Clinton's policy for INDIA?", "What will be Hillary Clinton's India policy?"),
    ("What's the difference between IITs and other colleges?", "What is the difference between IIT and other colleges?"),
    ("What do you think of India’s surgical strikes?", "What do you think about India's surgical strikes?"),
    ("What do you think of the surgical strike by the Indian army?", "What do you think of India's surgical strike?"),
    ("Who was Frederick Douglass? What were his contributions?", "Who was Frederick Douglass?"),
    ("Do aliens exist? If yes, where?", "Do aliens really exist?"),
    ("Can you justify the appointment of Mr. Urjit Patel?", "What do you think of the appointment of Urjit Patel?"),
    ("Why do Germans love beer?", "Why do German people love beer?"),
]

DIFFERENT_NAMES = [
    ("When was George Bush born?", "When was George Washington born?"),
    ("Was Elvis Presley overrated?", "Is Elvis overrated?"),  # the other prompt never says "Presley"
    ("What is the capital of Niger?", "What is the capital of Nigeria?"),
    ("What is the population of New York?", "What is the population of York?"),
    ("What do you think of Mr. Modi's policies?", "What do you think of Mr. Gandhi's policies?"),
    ("How do I install Docker on Windows?", "How do I install Docker?"),
]


@pytest.mark.parametrize("a,b", SAME_NAMES)
def test_the_same_name_written_another_way_is_no_reason_to_miss(a, b):
    assert different_question(a, b) is None
    assert different_question(b, a) is None


@pytest.mark.parametrize("a,b", DIFFERENT_NAMES)
def test_a_name_only_one_prompt_says_makes_another_question(a, b):
    assert different_question(a, b) == "entities"
    assert different_question(b, a) == "entities"


SAME_CONVERSION = [
    ("How many km is 5 miles?", "5 miles is how many km?"),
    ("How many km are in a mile?", "A mile is how many km?"),
    ("How far is 5 km in miles?", "What is 5 km in miles?"),
    ("How much is $30 in EUR?", "$30 is how much in EUR?"),
]

OTHER_WAY_ROUND = [
    ("How many miles is 7 km?", "How many km is 7 miles?"),
    ("What is 30 USD in EUR?", "What is 30 EUR in USD?"),
    ("How many kg is 3 pounds?", "How many pounds is 3 kg?"),
    ("What is 26 C in F?", "What is 26 F in C?"),  # units written short
    ("How many km is 28 mi?", "How many mi is 28 km?"),
    ("Convert 27 $ to €", "Convert 27 € to $"),  # currency signs
    ("What is CAD 30 in JPY?", "What is JPY 30 in CAD?"),  # a code before its number
]


@pytest.mark.parametrize("a,b", SAME_CONVERSION)
def test_a_conversion_in_other_words_is_the_same_question(a, b):
    assert different_question(a, b) is None


@pytest.mark.parametrize("a,b", OTHER_WAY_ROUND)
def test_a_conversion_the_other_way_round_is_another_question(a, b):
    assert different_question(a, b) == "swapped roles"
