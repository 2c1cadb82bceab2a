"""A deterministic English-like text corpus for training the tiny model's tokenizer.

Contract: ``generate_corpus(seed)`` returns the same list of strings for the same seed on
every machine and Python version (it only uses ``random.Random.random``/``choice``/
``randrange``, whose streams Python keeps stable for a given seed). Nothing is read from
disk, so the tokenizer does not depend on what happens to be installed.
"""

from __future__ import annotations

import random

# Word lists are small on purpose: the corpus only has to teach a 2,048-token BPE the
# shapes of English (frequent words, suffixes, spaces before words, punctuation, digits).
_NAMES = tuple(
    "Alice Bob Carol David Emma Frank Grace Henry Iris Jack Kate Liam Maria Noah Olivia Paul "
    "Quinn Rosa Sam Tara ".split()
)
_PLACES = tuple(
    "Paris London Berlin Madrid Rome Tokyo Lisbon Vienna Oslo Cairo Lima Delhi Seoul Sydney "
    "Toronto France Spain Italy Germany Japan Portugal Austria Norway Egypt Peru India "
    "Canada".split()
)
_NOUNS = tuple(
    "cat dog house river city book table window garden tree computer server request model "
    "token cache memory layer network teacher student child friend market road train ship "
    "bird letter question answer story song morning evening night day water bread coffee "
    "music language country capital mountain sea family problem reason idea system program "
    "number world time ".split()
)
_ADJECTIVES = tuple(
    "small large old new quick slow bright dark happy quiet busy simple strange famous green "
    "blue red warm cold early late useful careful beautiful important different good great ".split()
)
_VERBS = tuple(
    tuple(pair.split("/"))
    for pair in (
        "sees/saw finds/found makes/made takes/took reads/read writes/wrote likes/liked "
        "visits/visited builds/built opens/opened carries/carried watches/watched "
        "helps/helped answers/answered sends/sent keeps/kept serves/served computes/computed "
        "stores/stored moves/moved "
    ).split()
)
_ADVERBS = tuple(
    "quickly slowly carefully often never always sometimes today yesterday again together "
    "really almost finally suddenly ".split()
)
_PREPOSITIONS = ("in", "on", "near", "under", "behind", "with", "without", "after", "before")
_CONNECTIVES = ("and", "but", "because", "so", "while", "although", "when", "then")
_QUESTIONS = (
    "What is the capital of {place}?",
    "Where is the {adj} {noun}?",
    "Why does {name} like the {noun}?",
    "How many {noun}s are there in {place}?",
    "Can you tell me a story about a {adj} {noun}?",
    "Who wrote the {noun} about {place}?",
    "Hello! How are you today?",
    "Please explain what a {noun} is.",
)
_ANSWERS = (
    "The capital of {place} is {place2}.",
    "I think the {noun} is {prep} the {noun2}.",
    "{name} likes the {noun} because it is {adj}.",
    "There are {num} {noun}s in {place}.",
    "Sure. Once upon a time, a {adj} {noun} lived {prep} a {adj2} {noun2}.",
    "I am fine, thank you. How can I help you?",
    "A {noun} is a {adj} thing that people use every day.",
)


def _noun_phrase(rng: random.Random) -> str:
    det = rng.choice(("the", "a", "this", "that", "every", "my", "our"))
    if rng.random() < 0.5:
        return f"{det} {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    noun = rng.choice(_NOUNS)
    if det in ("the", "my", "our") and rng.random() < 0.3:
        noun += "s"
    return f"{det} {noun}"


def _clause(rng: random.Random) -> str:
    subject = rng.choice(_NAMES) if rng.random() < 0.4 else _noun_phrase(rng)
    present, past = rng.choice(_VERBS)
    verb = present if rng.random() < 0.5 else past
    parts = [subject, verb, _noun_phrase(rng)]
    if rng.random() < 0.5:
        parts += [rng.choice(_PREPOSITIONS), rng.choice(_PLACES)]
    if rng.random() < 0.3:
        parts.append(rng.choice(_ADVERBS))
    return " ".join(parts)


def _sentence(rng: random.Random) -> str:
    text = _clause(rng)
    if rng.random() < 0.35:
        text += f", {rng.choice(_CONNECTIVES)} {_clause(rng)}"
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", "?"))


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        place=rng.choice(_PLACES),
        place2=rng.choice(_PLACES),
        name=rng.choice(_NAMES),
        noun=rng.choice(_NOUNS),
        noun2=rng.choice(_NOUNS),
        adj=rng.choice(_ADJECTIVES),
        adj2=rng.choice(_ADJECTIVES),
        prep=rng.choice(_PREPOSITIONS),
        num=rng.randrange(2, 2000),
    )


def _paragraph(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:  # prose
        return " ".join(_sentence(rng) for _ in range(rng.randrange(2, 7)))
    if kind < 0.85:  # dialogue, so chat-like text tokenizes into sensible pieces
        return f"{_fill(rng.choice(_QUESTIONS), rng)}\n{_fill(rng.choice(_ANSWERS), rng)}"
    # numbers, lists and a little code-ish text, so digits and symbols get merges too
    items = ", ".join(str(rng.randrange(0, 10_000)) for _ in range(rng.randrange(3, 8)))
    name = rng.choice(_NOUNS)
    return f"- {name}_count = {rng.randrange(100)}; values = [{items}]\n- total: {items}"


def generate_corpus(seed: int = 0, paragraphs: int = 1200) -> list[str]:
    """Return ``paragraphs`` deterministic English-like paragraphs (about 170 bytes each).

    The default gives about 200 KB, enough to fill a 2,048-token vocabulary with real
    word pieces while keeping BPE training well under a second.
    """
    rng = random.Random(seed)
    return [_paragraph(rng) for _ in range(paragraphs)]
