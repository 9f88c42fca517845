"""Generate the bundled offline smoke corpus of synthetic English-like documents.

Every document is produced here from small templates and a vocabulary of a few hundred
words: short stories with recurring characters, places and objects followed by questions
about them, arithmetic facts in words and digits, counting sequences, lists, question and
answer drills over a fixed set of world facts, and simple dialogues. The text is varied
enough not to be memorised at once, yet regular enough that a tiny transformer visibly
learns it within a few hundred steps.

Output is JSON Lines, one `{"text": ...}` document per line. The train and validation
splits draw from independent random streams derived from `--seed`, and the output is
byte-identical across runs and platforms.

Usage:
    python scripts/make_smoke_corpus.py [--out-dir DIR] [--train-bytes N] [--val-bytes N]
                                        [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "torchtitan" / "assets" / "smoke_corpus"
DEFAULT_TRAIN_BYTES = 3_000_000
DEFAULT_VAL_BYTES = 150_000
MIN_WORDS = 50
MAX_WORDS = 400


def words(text: str) -> list[str]:
    """The whitespace-separated words of a string, for compact vocabulary tables."""
    return text.split()


def word_pairs(text: str) -> dict[str, str]:
    """A mapping written compactly as "key:value key:value ..."."""
    return dict(pair.split(":") for pair in words(text))


SHE_NAMES = words(
    "Anna Clara Emma Grace Ivy Lily Nora Rosa Zoe Mia Ella Ruby Alice Hannah Julia Sara Olivia Maya Lucy Eva"
)
HE_NAMES = words(
    "Ben David Finn Henry Jack Max Oscar Sam Tom Leo Owen Hugo Adam Lucas Noah Peter Daniel Felix Milo Theo"
)
PLACES = words(
    "park garden kitchen school forest beach library market farm river hill station bakery "
    "castle village lake meadow harbor bridge cave zoo island tower mill pond field road "
    "square shop museum orchard desert valley mountain"
)
THINGS = words(
    "ball book cup hat kite box key lamp map coin shell bell drum boat flower stone letter "
    "clock basket blanket pencil ring bottle feather scarf candle spoon umbrella ribbon "
    "whistle mirror shoe glove rope bag button brush jar plate sock pillow kettle bucket "
    "ladder wagon trumpet puzzle crayon marble teapot"
)
COLORS = words("red blue green yellow white black brown orange purple pink gray gold")
SIZES = words("big small old new soft shiny heavy tiny long round little tall short clean dirty")
FEELINGS = words(
    "happy sad tired hungry scared excited calm surprised proud sleepy worried glad brave "
    "lonely cheerful curious bored shy"
)
WEATHER = words("sunny rainy windy cold warm cloudy snowy foggy")
TIMES_OF_DAY = words("morning afternoon evening")
DAYS = words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
FOODS = words(
    "bread soup rice cheese milk tea eggs pie honey fish carrots plums apples pears cookies "
    "jam nuts berries cake beans oranges grapes potatoes butter noodles pancakes salad corn "
    "peas lemons muffins yogurt melon cherries peaches"
)
ROLE_DUTIES = {
    "farmer": "grows corn and feeds the cows",
    "baker": "bakes bread and cakes",
    "teacher": "teaches children to read and write",
    "painter": "paints pictures and walls",
    "sailor": "sails a ship across the sea",
    "doctor": "helps people who are sick",
    "singer": "sings songs for everyone",
    "builder": "builds houses and bridges",
    "gardener": "plants flowers and trims the trees",
    "writer": "writes books and stories",
    "tailor": "sews shirts, coats and dresses",
    "fisher": "catches fish in the river",
    "pilot": "flies an airplane high in the sky",
    "cook": "cooks meals in a big kitchen",
    "driver": "drives a bus through the town",
    "miller": "grinds wheat into flour",
    "guard": "watches the gate of the castle",
    "dancer": "dances on a stage",
}
BODY_PARTS = {
    **dict.fromkeys(words("eyes ears hands thumbs feet arms legs knees elbows shoulders"), 2),
    "fingers": 10,
    "toes": 10,
}
WEATHER_CLOTHES = {
    "sunny": "a sun hat",
    "rainy": "a raincoat and boots",
    "windy": "a jacket",
    "cold": "a warm coat",
    "warm": "a light shirt",
    "cloudy": "a sweater",
    "snowy": "mittens and a wool scarf",
    "foggy": "a bright vest",
}
ROLES = list(ROLE_DUTIES)
CHORES = words("painted washed fixed opened cleaned carried wrapped polished mended filled")
SPOTS = [
    "under a tree",
    "near the door",
    "in the grass",
    "behind a rock",
    "on the table",
    "in the sand",
    "next to the path",
    "inside an old box",
    "under the bed",
    "on a high shelf",
]
ADMIRING_WORDS = words("nice lovely strange beautiful funny pretty wonderful")
RELATIVES = words("mother father sister brother grandmother grandfather aunt uncle cousin")
ROUTINE_STEPS = [
    (6, "wakes up and opens the window"),
    (7, "washes {possessive} face and brushes {possessive} hair"),
    (8, "eats {food} and {other_food} for breakfast"),
    (9, "walks to the {place}"),
    (10, "reads a book about {animals}"),
    (11, "writes a letter to {friend}"),
    (12, "eats {food} for lunch"),
    (13, "plays with {possessive} {thing}"),
    (14, "helps {friend} at the {place}"),
    (15, "paints a picture of {a_thing}"),
    (16, "feeds the {animals}"),
    (18, "cooks {food} for dinner"),
    (19, "sings a song with {possessive} {relative}"),
    (21, "goes to bed"),
]


@dataclass(frozen=True)
class Animal:
    """An animal with the facts that question/answer documents ask about."""

    name: str
    plural: str
    legs: int
    sound: str
    home: str


ANIMALS = [
    Animal("cat", "cats", 4, "meow", "a house"),
    Animal("dog", "dogs", 4, "woof", "a kennel"),
    Animal("bird", "birds", 2, "tweet", "a nest"),
    Animal("duck", "ducks", 2, "quack", "a pond"),
    Animal("cow", "cows", 4, "moo", "a barn"),
    Animal("sheep", "sheep", 4, "baa", "a field"),
    Animal("owl", "owls", 2, "hoot", "a tree"),
    Animal("frog", "frogs", 4, "croak", "a pond"),
    Animal("mouse", "mice", 4, "squeak", "a hole"),
    Animal("horse", "horses", 4, "neigh", "a stable"),
    Animal("pig", "pigs", 4, "oink", "a pen"),
    Animal("hen", "hens", 2, "cluck", "a coop"),
    Animal("bear", "bears", 4, "growl", "a cave"),
    Animal("bee", "bees", 6, "buzz", "a hive"),
    Animal("spider", "spiders", 8, "nothing", "a web"),
    Animal("lion", "lions", 4, "roar", "a den"),
    Animal("wolf", "wolves", 4, "howl", "a den"),
    Animal("snake", "snakes", 0, "hiss", "a hole"),
    Animal("donkey", "donkeys", 4, "hee-haw", "a stable"),
    Animal("crow", "crows", 2, "caw", "a tree"),
    Animal("cricket", "crickets", 6, "chirp", "the grass"),
    Animal("goat", "goats", 4, "maa", "a field"),
]

THING_COLORS = word_pairs(
    "sky:blue grass:green snow:white sun:yellow coal:black tomato:red carrot:orange "
    "plum:purple leaf:green lemon:yellow cloud:white strawberry:red banana:yellow sea:blue"
)

MONTHS = words("January February March April May June July August September October November December")
SEASONS = {
    "spring": "the flowers open and the birds sing",
    "summer": "it is hot and we swim in the lake",
    "autumn": "the leaves fall and the wind blows",
    "winter": "it is cold and snowy",
}
SHAPE_SIDES = {"triangle": 3, "square": 4, "rectangle": 4, "pentagon": 5, "hexagon": 6}
OPPOSITES = word_pairs(
    "big:small hot:cold up:down day:night happy:sad fast:slow open:closed light:dark wet:dry "
    "full:empty loud:quiet early:late left:right high:low long:short soft:hard near:far "
    "first:last clean:dirty young:old"
)

ONES = words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
)
TENS = ["", "", *words("twenty thirty forty fifty sixty seventy eighty ninety")]


@dataclass(frozen=True)
class Person:
    """A character with the pronouns templates need."""

    name: str
    subject: str
    object: str
    possessive: str


@dataclass
class Story:
    """The cast and props of one story, and the questions its sentences can answer."""

    hero: Person
    friend: Person
    home: str
    place: str
    color: str
    thing: str
    animal: Animal
    food: str
    questions: list[tuple[str, str]] = field(default_factory=list)


def number_to_words(number: int) -> str:
    """Spell a number from 0 to 999 in English words, e.g. 42 -> "forty-two"."""
    if number < 20:
        return ONES[number]
    if number < 100:
        tens, ones = divmod(number, 10)
        return TENS[tens] + (f"-{ONES[ones]}" if ones else "")
    hundreds, rest = divmod(number, 100)
    head = f"{ONES[hundreds]} hundred"
    return f"{head} and {number_to_words(rest)}" if rest else head


def capitalize(text: str) -> str:
    """Upper-case the first character only, keeping the rest (names stay capitalised)."""
    return text[:1].upper() + text[1:]


def with_article(phrase: str) -> str:
    """Prefix "a" or "an" to a noun phrase by its first letter."""
    article = "an" if phrase[0] in "aeiou" else "a"
    return f"{article} {phrase}"


def plural(noun: str) -> str:
    """Regular English plural of a noun from the vocabulary."""
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def count_words(text: str) -> int:
    """Number of whitespace-separated words in a text."""
    return len(text.split())


def join_list(items: list[str]) -> str:
    """Join items as English prose: "a, b and c"."""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def pick_person(rng: random.Random, exclude: tuple[Person, ...] = ()) -> Person:
    """A random character, different by name from those in `exclude`."""
    taken = {person.name for person in exclude}
    while True:
        if rng.random() < 0.5:
            person = Person(rng.choice(SHE_NAMES), "she", "her", "her")
        else:
            person = Person(rng.choice(HE_NAMES), "he", "him", "his")
        if person.name not in taken:
            return person


def pick_distinct(rng: random.Random, pool: list[str], count: int) -> list[str]:
    """`count` different items from `pool`, in random order."""
    return rng.sample(pool, count)


def new_story(rng: random.Random) -> Story:
    """Choose the cast and props of a story."""
    hero = pick_person(rng)
    home, place = pick_distinct(rng, PLACES, 2)
    return Story(
        hero=hero,
        friend=pick_person(rng, (hero,)),
        home=home,
        place=place,
        color=rng.choice(COLORS),
        thing=rng.choice(THINGS),
        animal=rng.choice(ANIMALS),
        food=rng.choice(FOODS),
    )


def story_opening(story: Story, rng: random.Random) -> list[str]:
    """First sentences: who the hero is and where they live."""
    hero = story.hero
    story.questions.append((f"Where does {hero.name} live?", f"{hero.name} lives near the {story.home}."))
    variants = [
        [
            (
                f"Once upon a time, there was {with_article(rng.choice(SIZES))} "
                f"{rng.choice(ROLES)} named {hero.name}."
            ),
            (
                f"{capitalize(hero.subject)} lived in {with_article(rng.choice(COLORS))} house "
                f"near the {story.home}."
            ),
        ],
        [
            (
                f"One {rng.choice(WEATHER)} {rng.choice(DAYS)} {rng.choice(TIMES_OF_DAY)}, "
                f"{hero.name} woke up early."
            ),
            f"{capitalize(hero.subject)} lived near the {story.home}.",
        ],
        [
            (f"{hero.name} lived near the {story.home} and worked as {with_article(rng.choice(ROLES))}."),
            f"Every day {hero.subject} felt {rng.choice(FEELINGS)}.",
        ],
    ]
    return rng.choice(variants)


def story_friend(story: Story, rng: random.Random) -> list[str]:
    """Introduce the hero's friend."""
    hero, friend = story.hero, story.friend
    story.questions.append((f"Who is {hero.name}'s friend?", f"{friend.name} is."))
    return [
        rng.choice(
            [
                f"{hero.name} had a friend named {friend.name}.",
                f"{capitalize(hero.possessive)} best friend was {friend.name}.",
                f"{friend.name} was {hero.name}'s friend.",
            ]
        )
    ]


def story_find(story: Story, rng: random.Random) -> list[str]:
    """The hero finds the story's object."""
    hero = story.hero
    item = f"{story.color} {story.thing}"
    story.questions.append((f"What did {hero.name} find?", f"{hero.name} found {with_article(story.thing)}."))
    story.questions.append((f"What color was the {story.thing}?", f"It was {story.color}."))
    return [
        f"{hero.name} found {with_article(item)} {rng.choice(SPOTS)}.",
        f"{capitalize(hero.subject)} showed the {story.thing} to {story.friend.name}.",
        (f'{story.friend.name} said, "What {with_article(rng.choice(ADMIRING_WORDS))} {story.thing}!"'),
    ]


def story_travel(story: Story, rng: random.Random) -> list[str]:
    """Hero and friend go to the second place and meet the animal."""
    names = f"{story.hero.name} and {story.friend.name}"
    animal = story.animal.name
    story.questions.append((f"Where did {names} go?", f"They went to the {story.place}."))
    story.questions.append(("What animal did they see?", f"They saw {with_article(animal)}."))
    return [
        f"Then {names} walked to the {story.place}.",
        f"At the {story.place}, they saw {with_article(rng.choice(SIZES))} {animal}.",
        f"The {animal} looked {rng.choice(FEELINGS)}.",
    ]


def story_feed(story: Story, rng: random.Random) -> list[str]:
    """The hero feeds the animal."""
    hero, animal = story.hero, story.animal.name
    story.questions.append(
        (f"What did {hero.name} give the {animal}?", f"{hero.name} gave it some {story.food}.")
    )
    return [
        f"{hero.name} gave the {animal} some {story.food}.",
        f"The {animal} ate the {story.food} and looked {rng.choice(['happy', 'calm', 'glad'])}.",
    ]


def story_sound(story: Story, rng: random.Random) -> list[str]:
    """The animal makes its sound."""
    animal = story.animal
    if animal.sound == "nothing":
        return [f"The {animal.name} did not make a sound.", f"{story.friend.name} laughed."]
    return [
        f'The {animal.name} said, "{capitalize(animal.sound)}!"',
        f"{story.friend.name} laughed and said {animal.sound} too.",
    ]


def story_weather(story: Story, rng: random.Random) -> list[str]:
    """A change in the weather."""
    return rng.choice(
        [
            ["It started to rain, so they hid under a big tree.", "Soon the sun came out again."],
            ["The wind was strong and the sky was gray.", "They held their hats with both hands."],
            [f"The sky was {rng.choice(WEATHER)} and the air smelled of {rng.choice(FOODS)}."],
        ]
    )


def story_drop(story: Story, rng: random.Random) -> list[str]:
    """The hero drops the object and the friend returns it."""
    hero, friend = story.hero, story.friend
    return [
        f"On the way, {hero.name} dropped the {story.thing}.",
        f"{friend.name} picked it up and gave it back to {hero.object}.",
        f'"Thank you, {friend.name}," said {hero.name}.',
    ]


def story_count(story: Story, rng: random.Random) -> list[str]:
    """The hero counts animals, which a question asks about."""
    hero, animal = story.hero, story.animal
    number = rng.randint(2, 12)
    story.questions.append(
        (
            f"How many {animal.plural} did {hero.name} count?",
            f"{capitalize(number_to_words(number))}.",
        )
    )
    return [f"{hero.name} counted {number_to_words(number)} {animal.plural} near the {story.place}."]


def story_chore(story: Story, rng: random.Random) -> list[str]:
    """Hero and friend do a small job together."""
    other_thing = rng.choice([thing for thing in THINGS if thing != story.thing])
    minutes = rng.choice([5, 10, 15, 20, 30])
    names = f"{story.hero.name} and {story.friend.name}"
    return [
        f"{names} {rng.choice(CHORES)} the {other_thing} together.",
        f"It took them {number_to_words(minutes)} minutes.",
    ]


def story_lunch(story: Story, rng: random.Random) -> list[str]:
    """Hero and friend eat."""
    first, second = pick_distinct(rng, FOODS, 2)
    return [
        f"At noon they sat on the grass and ate {first} and {second}.",
        f"{story.friend.name} said the {second} was very good.",
    ]


def story_play(story: Story, rng: random.Random) -> list[str]:
    """Hero and friend play a game."""
    return [
        rng.choice(
            [
                "They played a game of hide and seek.",
                "They ran up the hill and rolled down again.",
                "They sang a song about the sun and the moon.",
                f"They threw the {story.thing} back and forth.",
            ]
        ),
        (
            f"{story.hero.name} felt {rng.choice(FEELINGS)} and {story.friend.name} felt "
            f"{rng.choice(FEELINGS)}."
        ),
    ]


def story_ending(story: Story, rng: random.Random) -> list[str]:
    """Closing sentences."""
    hero = story.hero
    return [
        f"When the {rng.choice(['evening', 'night'])} came, {hero.name} went home.",
        (
            f"{capitalize(hero.subject)} put the {story.color} {story.thing} on "
            f"{hero.possessive} shelf and smiled."
        ),
        "The end.",
    ]


CORE_EVENTS = [story_opening, story_friend, story_find, story_travel]
EXTRA_EVENTS = [
    story_feed,
    story_sound,
    story_weather,
    story_drop,
    story_count,
    story_lunch,
    story_play,
    story_chore,
]


def make_story(rng: random.Random, target_words: int) -> str:
    """A short story, optionally followed by questions about it."""
    story = new_story(rng)
    paragraphs = [" ".join(event(story, rng)) for event in CORE_EVENTS]
    extras = rng.sample(EXTRA_EVENTS, len(EXTRA_EVENTS))
    while extras and count_words("\n\n".join(paragraphs)) < target_words:
        paragraphs.append(" ".join(extras.pop()(story, rng)))
    paragraphs.append(" ".join(story_ending(story, rng)))
    if rng.random() < 0.7:
        asked = rng.sample(story.questions, min(len(story.questions), rng.randint(2, 5)))
        paragraphs.append("\n".join(f"Q: {q}\nA: {a}" for q, a in asked))
    return "\n\n".join(paragraphs)


def sum_fact(rng: random.Random) -> str:
    """An addition fact in words and digits."""
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return (
        f"{capitalize(number_to_words(a))} plus {number_to_words(b)} is "
        f"{number_to_words(a + b)}. {a} + {b} = {a + b}."
    )


def big_sum_fact(rng: random.Random) -> str:
    """An addition fact with two-digit numbers."""
    a, b = rng.randint(10, 60), rng.randint(10, 60)
    return (
        f"{capitalize(number_to_words(a))} plus {number_to_words(b)} is "
        f"{number_to_words(a + b)}. {a} + {b} = {a + b}."
    )


def difference_fact(rng: random.Random) -> str:
    """A subtraction fact with a non-negative result."""
    a = rng.randint(1, 30)
    b = rng.randint(0, a)
    return (
        f"{capitalize(number_to_words(a))} minus {number_to_words(b)} is "
        f"{number_to_words(a - b)}. {a} - {b} = {a - b}."
    )


def product_fact(rng: random.Random) -> str:
    """A times-table fact."""
    a, b = rng.randint(1, 12), rng.randint(1, 12)
    return (
        f"{capitalize(number_to_words(a))} times {number_to_words(b)} is "
        f"{number_to_words(a * b)}. {a} x {b} = {a * b}."
    )


def sum_question(rng: random.Random) -> str:
    """An addition question and its answer."""
    a, b = rng.randint(1, 15), rng.randint(1, 15)
    return f"What is {number_to_words(a)} plus {number_to_words(b)}? The answer is {a + b}."


def comparison_fact(rng: random.Random) -> str:
    """Which of two numbers is larger."""
    a, b = pick_distinct(rng, list(range(21)), 2)
    word = "more" if a > b else "less"
    sign = ">" if a > b else "<"
    return f"{capitalize(number_to_words(a))} is {word} than {number_to_words(b)}. {a} {sign} {b}."


def doubling_fact(rng: random.Random) -> str:
    """Doubling and halving."""
    a = rng.randint(1, 25)
    return (
        f"Double {number_to_words(a)} is {number_to_words(2 * a)}, "
        f"and half of {number_to_words(2 * a)} is {number_to_words(a)}."
    )


def gift_problem(rng: random.Random) -> str:
    """A word problem where someone receives more of something."""
    owner = pick_person(rng)
    giver = pick_person(rng, (owner,))
    things = plural(rng.choice(THINGS))
    a, b = rng.randint(2, 12), rng.randint(1, 9)
    return (
        f"{owner.name} has {number_to_words(a)} {things}. {giver.name} gives {owner.object} "
        f"{number_to_words(b)} more. Now {owner.name} has {number_to_words(a + b)} {things}."
    )


def spending_problem(rng: random.Random) -> str:
    """A word problem where someone spends coins."""
    buyer = pick_person(rng)
    a = rng.randint(4, 20)
    b = rng.randint(2, a - 2)
    food = rng.choice(FOODS)
    return (
        f"{buyer.name} had {a} coins and spent {b} coins on {food} at the market. "
        f"{capitalize(buyer.subject)} has {a - b} coins left, because {a} - {b} = {a - b}."
    )


def price_problem(rng: random.Random) -> str:
    """A multiplication word problem about prices."""
    food = rng.choice(["apples", "pears", "plums", "lemons", "oranges", "muffins", "peaches"])
    count, price = rng.randint(2, 9), rng.randint(2, 9)
    return (
        f"One of the {food} costs {price} coins. {capitalize(number_to_words(count))} {food} "
        f"cost {count * price} coins, because {count} x {price} = {count * price}."
    )


ARITHMETIC_FACTS = [
    sum_fact,
    big_sum_fact,
    difference_fact,
    product_fact,
    sum_question,
    comparison_fact,
    doubling_fact,
    gift_problem,
    spending_problem,
    price_problem,
]


def make_arithmetic(rng: random.Random, target_words: int) -> str:
    """A page of arithmetic practice drawn from a few fact kinds."""
    title = rng.choice(["Math practice.", "Let us do some sums.", "Numbers for today."])
    kinds = rng.sample(ARITHMETIC_FACTS, rng.randint(2, 4))
    lines = [title]
    while count_words("\n".join(lines)) < target_words:
        lines.append(rng.choice(kinds)(rng))
    return "\n".join(lines)


def count_up(rng: random.Random) -> str:
    """Count from one number to another, in words then digits."""
    start = rng.randint(0, 190)
    numbers = list(range(start, start + rng.randint(4, 10)))
    spelled = ", ".join(number_to_words(n) for n in numbers)
    digits = ", ".join(str(n) for n in numbers)
    return (
        f"Let us count from {number_to_words(numbers[0])} to {number_to_words(numbers[-1])}: "
        f"{spelled}. In digits: {digits}."
    )


def count_by(rng: random.Random) -> str:
    """Skip counting by a fixed step."""
    step, name = rng.choice([(2, "twos"), (3, "threes"), (5, "fives"), (10, "tens")])
    numbers = [step * i for i in range(1, rng.randint(5, 10))]
    return f"Now we count by {name}: " + ", ".join(str(n) for n in numbers) + "."


def count_down(rng: random.Random) -> str:
    """Count backwards to zero or one."""
    start = rng.randint(5, 12)
    end = rng.choice([0, 1])
    spelled = ", ".join(number_to_words(n) for n in range(start, end - 1, -1))
    return f"Count backwards from {number_to_words(start)}: {spelled}."


def neighbours(rng: random.Random) -> str:
    """The numbers just after and just before a number."""
    n = rng.randint(1, 199)
    return (
        f"The number after {number_to_words(n)} is {number_to_words(n + 1)}. "
        f"The number before {number_to_words(n)} is {number_to_words(n - 1)}. "
        f"In digits: {n - 1}, {n}, {n + 1}."
    )


def week_days(rng: random.Random) -> str:
    """Days of the week and their order."""
    index = rng.randrange(len(DAYS))
    following = DAYS[(index + 1) % len(DAYS)]
    return f"The days of the week are {join_list(DAYS)}. After {DAYS[index]} comes {following}."


def year_months(rng: random.Random) -> str:
    """Months of the year, their order, and someone's birthday."""
    index = rng.randrange(len(MONTHS))
    person = pick_person(rng)
    age = rng.randint(3, 12)
    return (
        f"There are twelve months in a year. After {MONTHS[index]} comes "
        f"{MONTHS[(index + 1) % len(MONTHS)]}. {person.name}'s birthday is in "
        f"{rng.choice(MONTHS)}, and {person.subject} will be {number_to_words(age)} years old."
    )


def count_animals(rng: random.Random) -> str:
    """Counting animals one by one."""
    counter = pick_person(rng)
    animal = rng.choice(ANIMALS)
    total = rng.randint(3, 7)
    steps = [f"{number_to_words(1)} {animal.name}"]
    steps += [f"{number_to_words(n)} {animal.plural}" for n in range(2, total + 1)]
    return (
        f"{counter.name} counted the {animal.plural} at the farm: {', '.join(steps)}. "
        f"There were {total} {animal.plural} in all."
    )


COUNTING_KINDS = [
    count_up,
    count_by,
    count_down,
    neighbours,
    week_days,
    year_months,
    count_animals,
]


def make_counting(rng: random.Random, target_words: int) -> str:
    """A page of counting exercises."""
    paragraphs = [rng.choice(["Counting practice.", "Let us count together."])]
    while count_words("\n\n".join(paragraphs)) < target_words:
        paragraphs.append(rng.choice(COUNTING_KINDS)(rng))
    return "\n\n".join(paragraphs)


def shopping_list(rng: random.Random) -> str:
    """A numbered shopping list."""
    shopper = pick_person(rng)
    foods = pick_distinct(rng, FOODS, rng.randint(3, 7))
    lines = [f"{shopper.name}'s shopping list for {rng.choice(DAYS)}:"]
    lines += [f"{index}. {food}" for index, food in enumerate(foods, start=1)]
    lines.append(f"That is {number_to_words(len(foods))} things to buy at the market.")
    return "\n".join(lines)


def packing_list(rng: random.Random) -> str:
    """What someone packs for a trip."""
    traveller = pick_person(rng)
    things = [with_article(thing) for thing in pick_distinct(rng, THINGS, rng.randint(3, 6))]
    return (
        f"For the trip to the {rng.choice(PLACES)}, {traveller.name} packed "
        f"{join_list(things)}. {capitalize(traveller.subject)} packed "
        f"{number_to_words(len(things))} things."
    )


def room_list(rng: random.Random) -> str:
    """Coloured things found in a place."""
    place = rng.choice(PLACES)
    things = pick_distinct(rng, THINGS, rng.randint(3, 5))
    items = [with_article(f"{rng.choice(COLORS)} {thing}") for thing in things]
    return f"In the {place} there are {join_list(items)}."


def colour_list(rng: random.Random) -> str:
    """Things of one colour, using the fixed world facts."""
    color = rng.choice(sorted(set(THING_COLORS.values())))
    things = [thing for thing, value in THING_COLORS.items() if value == color]
    if len(things) == 1:
        return f"The {things[0]} is {color}."
    return f"Things that are {color}: " + ", ".join(f"the {thing}" for thing in things) + "."


def pet_list(rng: random.Random) -> str:
    """Someone's pets."""
    owner = pick_person(rng)
    pets = [with_article(animal.name) for animal in rng.sample(ANIMALS, rng.randint(2, 4))]
    return (
        f"{owner.name} has {number_to_words(len(pets))} pets: {join_list(pets)}. "
        f"{capitalize(owner.subject)} feeds them every {rng.choice(TIMES_OF_DAY)}."
    )


LIST_KINDS = [shopping_list, packing_list, room_list, colour_list, pet_list]


def make_lists(rng: random.Random, target_words: int) -> str:
    """A page of short lists."""
    paragraphs: list[str] = []
    while count_words("\n\n".join(paragraphs)) < target_words:
        paragraphs.append(rng.choice(LIST_KINDS)(rng))
    return "\n\n".join(paragraphs)


def colour_question(rng: random.Random) -> tuple[str, str]:
    """What colour a thing is."""
    thing = rng.choice(sorted(THING_COLORS))
    return f"What color is the {thing}?", f"The {thing} is {THING_COLORS[thing]}."


def legs_question(rng: random.Random) -> tuple[str, str]:
    """How many legs an animal has."""
    animal = rng.choice(ANIMALS)
    legs = number_to_words(animal.legs)
    return (f"How many legs does a {animal.name} have?", f"A {animal.name} has {legs} legs.")


def sound_question(rng: random.Random) -> tuple[str, str]:
    """What an animal says."""
    animal = rng.choice(ANIMALS)
    return f"What does a {animal.name} say?", f"A {animal.name} says {animal.sound}."


def home_question(rng: random.Random) -> tuple[str, str]:
    """Where an animal lives."""
    animal = rng.choice(ANIMALS)
    return (f"Where does a {animal.name} live?", f"A {animal.name} lives in {animal.home}.")


def day_question(rng: random.Random) -> tuple[str, str]:
    """Which day follows another."""
    index = rng.randrange(len(DAYS))
    following = DAYS[(index + 1) % len(DAYS)]
    return (f"What day comes after {DAYS[index]}?", f"{following} comes after {DAYS[index]}.")


def sum_answer(rng: random.Random) -> tuple[str, str]:
    """A sum asked in words."""
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    question = f"What is {number_to_words(a)} plus {number_to_words(b)}?"
    return (question, f"{capitalize(number_to_words(a))} plus {number_to_words(b)} is {a + b}.")


def month_question(rng: random.Random) -> tuple[str, str]:
    """Which month follows another."""
    index = rng.randrange(len(MONTHS))
    following = MONTHS[(index + 1) % len(MONTHS)]
    return f"What month comes after {MONTHS[index]}?", f"{following} comes after {MONTHS[index]}."


def season_question(rng: random.Random) -> tuple[str, str]:
    """What happens in a season."""
    season = rng.choice(sorted(SEASONS))
    return f"What happens in {season}?", f"In {season}, {SEASONS[season]}."


def shape_question(rng: random.Random) -> tuple[str, str]:
    """How many sides a shape has."""
    shape = rng.choice(sorted(SHAPE_SIDES))
    sides = number_to_words(SHAPE_SIDES[shape])
    return f"How many sides does a {shape} have?", f"A {shape} has {sides} sides."


def opposite_question(rng: random.Random) -> tuple[str, str]:
    """The opposite of a word, asked in either direction."""
    word, opposite = rng.choice(sorted(OPPOSITES.items()))
    if rng.random() < 0.5:
        word, opposite = opposite, word
    return f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."


def role_question(rng: random.Random) -> tuple[str, str]:
    """What a person with a given job does."""
    role = rng.choice(sorted(ROLE_DUTIES))
    return (
        f"What does {with_article(role)} do?",
        f"{capitalize(with_article(role))} {ROLE_DUTIES[role]}.",
    )


def body_question(rng: random.Random) -> tuple[str, str]:
    """How many of a body part a person has."""
    part = rng.choice(sorted(BODY_PARTS))
    count = number_to_words(BODY_PARTS[part])
    return f"How many {part} does a person have?", f"A person has {count} {part}."


def clothes_question(rng: random.Random) -> tuple[str, str]:
    """What to wear in some weather."""
    weather = rng.choice(WEATHER)
    return (
        f"What do you wear when it is {weather}?",
        f"When it is {weather}, I wear {WEATHER_CLOTHES[weather]}.",
    )


WORLD_QUESTIONS = [
    colour_question,
    legs_question,
    sound_question,
    home_question,
    day_question,
    sum_answer,
    month_question,
    season_question,
    shape_question,
    opposite_question,
    role_question,
    body_question,
    clothes_question,
]


def owned_items_section(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """Facts stated in the document, and questions only answerable by reading them."""
    owners = [pick_person(rng)]
    owners.append(pick_person(rng, tuple(owners)))
    facts, questions = [], []
    for owner, thing in zip(owners, pick_distinct(rng, THINGS, 2)):
        color, place = rng.choice(COLORS), rng.choice(PLACES)
        facts.append(f"{owner.name} has {with_article(color)} {thing}.")
        facts.append(f"{capitalize(owner.possessive)} {thing} is in the {place}.")
        questions.append((f"What color is {owner.name}'s {thing}?", f"It is {color}."))
        questions.append((f"Where is {owner.name}'s {thing}?", f"It is in the {place}."))
    return " ".join(facts), rng.sample(questions, len(questions))


def make_questions(rng: random.Random, target_words: int) -> str:
    """Question/answer pairs about world facts, sometimes about facts stated first."""
    paragraphs = []
    if rng.random() < 0.5:
        facts, questions = owned_items_section(rng)
        paragraphs.append(facts)
        paragraphs.extend(f"Q: {q}\nA: {a}" for q, a in questions)
    while count_words("\n\n".join(paragraphs)) < target_words:
        question, answer = rng.choice(WORLD_QUESTIONS)(rng)
        paragraphs.append(f"Q: {question}\nA: {answer}")
    return "\n\n".join(paragraphs)


def talk_plans(rng: random.Random, a: Person, b: Person) -> list[str]:
    """A invites B somewhere."""
    place = rng.choice(PLACES)
    reply = rng.choice(
        [f"Yes, I would like that, {a.name}.", f"Sorry, {a.name}, I am too {rng.choice(FEELINGS)}."]
    )
    return [f"{a.name}: I am going to the {place}. Do you want to come?", f"{b.name}: {reply}"]


def talk_found_thing(rng: random.Random, a: Person, b: Person) -> list[str]:
    """A shows B something they found."""
    thing, color, place = rng.choice(THINGS), rng.choice(COLORS), rng.choice(PLACES)
    return [
        f"{a.name}: Look, I found {with_article(color)} {thing} at the {place}.",
        f"{b.name}: What {with_article(rng.choice(ADMIRING_WORDS))} {thing}! Can I hold it?",
        f"{a.name}: Yes, here you are.",
    ]


def talk_food(rng: random.Random, a: Person, b: Person) -> list[str]:
    """A is hungry and B offers food."""
    food = rng.choice(FOODS)
    return [
        f"{a.name}: I am hungry. Do you have any food?",
        f"{b.name}: I have some {food}. Would you like some?",
        f"{a.name}: Yes, please. Thank you, {b.name}.",
    ]


def talk_weather(rng: random.Random, a: Person, b: Person) -> list[str]:
    """Small talk about the weather and what to wear."""
    weather = rng.choice(WEATHER)
    return [
        f"{a.name}: Is it {weather} today?",
        f"{b.name}: Yes, it is {weather}. Yesterday it was {rng.choice(WEATHER)}.",
        f"{a.name}: Then I will wear {WEATHER_CLOTHES[weather]}.",
    ]


def talk_job(rng: random.Random, a: Person, b: Person) -> list[str]:
    """What B wants to be when grown up."""
    role = rng.choice(sorted(ROLE_DUTIES))
    return [
        f"{a.name}: What do you want to be when you grow up?",
        f"{b.name}: I want to be {with_article(role)}.",
        f"{a.name}: That is good. {capitalize(with_article(role))} {ROLE_DUTIES[role]}.",
    ]


def talk_animal(rng: random.Random, a: Person, b: Person) -> list[str]:
    """A describes an animal they saw."""
    animal = rng.choice(ANIMALS)
    return [
        f"{a.name}: I saw {with_article(animal.name)} near the {rng.choice(PLACES)}.",
        f"{b.name}: Did it say {animal.sound}?",
        f"{a.name}: Yes! And it had {number_to_words(animal.legs)} legs.",
    ]


def talk_sum(rng: random.Random, a: Person, b: Person) -> list[str]:
    """A quizzes B on a sum."""
    x, y = rng.randint(1, 10), rng.randint(1, 10)
    return [
        f"{a.name}: What is {number_to_words(x)} plus {number_to_words(y)}?",
        f"{b.name}: It is {number_to_words(x + y)}.",
        f"{a.name}: {rng.choice(['Good', 'Right', 'Well done'])}, {b.name}!",
    ]


def talk_day(rng: random.Random, a: Person, b: Person) -> list[str]:
    """Which day it is and which comes next."""
    index = rng.randrange(len(DAYS))
    return [
        f"{a.name}: What day is it today?",
        f"{b.name}: It is {DAYS[index]}. Tomorrow is {DAYS[(index + 1) % len(DAYS)]}.",
    ]


DIALOGUE_TOPICS: list[Callable[[random.Random, Person, Person], list[str]]] = [
    talk_plans,
    talk_found_thing,
    talk_food,
    talk_weather,
    talk_animal,
    talk_sum,
    talk_day,
    talk_job,
]


def make_dialogue(rng: random.Random, target_words: int) -> str:
    """A conversation between two characters, one line per turn."""
    a = pick_person(rng)
    b = pick_person(rng, (a,))
    greeting = rng.choice(["Hello", "Hi", "Good morning"])
    lines = [
        f"{a.name}: {greeting}, {b.name}!",
        f"{b.name}: Hi, {a.name}. How are you today?",
        f"{a.name}: I am {rng.choice(FEELINGS)}. And you?",
        f"{b.name}: I am {rng.choice(FEELINGS)}, thank you.",
    ]
    while count_words("\n".join(lines)) < target_words:
        speakers = (b, a) if lines[-1].startswith(f"{a.name}:") else (a, b)
        lines += rng.choice(DIALOGUE_TOPICS)(rng, *speakers)
    lines += [f"{a.name}: Goodbye, {b.name}!", f"{b.name}: See you tomorrow, {a.name}!"]
    return "\n".join(lines)


def routine_fields(rng: random.Random, person: Person, friend: Person) -> dict[str, str]:
    """Values for the placeholders of ROUTINE_STEPS."""
    food, other_food = pick_distinct(rng, FOODS, 2)
    return {
        "possessive": person.possessive,
        "food": food,
        "other_food": other_food,
        "place": rng.choice(PLACES),
        "animals": rng.choice(ANIMALS).plural,
        "friend": friend.name,
        "thing": rng.choice(THINGS),
        "a_thing": with_article(f"{rng.choice(COLORS)} {rng.choice(THINGS)}"),
        "relative": rng.choice(RELATIVES),
    }


def clock_time(hour: int) -> str:
    """A whole hour of a 24-hour day as spoken, e.g. 15 -> "three o'clock in the afternoon"."""
    if hour == 12:
        return "noon"
    part = "morning" if hour < 12 else "afternoon" if hour < 18 else "evening"
    return f"{number_to_words((hour - 1) % 12 + 1)} o'clock in the {part}"


def daily_routine(rng: random.Random) -> str:
    """One character's day, hour by hour, followed by questions about it."""
    person = pick_person(rng)
    friend = pick_person(rng, (person,))
    middle = sorted(rng.sample(range(1, len(ROUTINE_STEPS) - 1), rng.randint(3, 7)))
    sentences = [f"This is what {person.name} does every {rng.choice(DAYS)}."]
    questions = []
    for step in [0, *middle, len(ROUTINE_STEPS) - 1]:
        hour, template = ROUTINE_STEPS[step]
        action = template.format(**routine_fields(rng, person, friend))
        sentences.append(f"At {clock_time(hour)}, {person.name} {action}.")
        questions.append(
            (
                f"What does {person.name} do at {clock_time(hour)}?",
                f"{capitalize(person.subject)} {action}.",
            )
        )
    asked = rng.sample(questions, rng.randint(1, 3))
    return "\n".join([" ".join(sentences), *(f"Q: {q}\nA: {a}" for q, a in asked)])


def make_routine(rng: random.Random, target_words: int) -> str:
    """Daily routines of one or more characters."""
    paragraphs: list[str] = []
    while count_words("\n\n".join(paragraphs)) < target_words:
        paragraphs.append(daily_routine(rng))
    return "\n\n".join(paragraphs)


def letter_sentences(rng: random.Random, friend: Person) -> list[str]:
    """First-person news a character might write to a friend, in a sensible order."""
    relative, other_relative = pick_distinct(rng, RELATIVES, 2)
    animal = rng.choice(ANIMALS)
    food, other_food = pick_distinct(rng, FOODS, 2)
    sentences = [
        f"Today I went to the {rng.choice(PLACES)} with my {relative}. We saw "
        f"{number_to_words(rng.randint(2, 9))} {animal.plural} there.",
        f"I found {with_article(rng.choice(COLORS))} {rng.choice(THINGS)} {rng.choice(SPOTS)}.",
        f"My {other_relative} made {food} and {other_food} for dinner.",
        f"The weather was {rng.choice(WEATHER)}, so we stayed inside and played games.",
        f"Yesterday I {rng.choice(CHORES)} my {rng.choice(THINGS)}.",
        f"I feel {rng.choice(FEELINGS)} today.",
        f"Next {rng.choice(DAYS)}, I will visit the {rng.choice(PLACES)}.",
        f"Can you come to my house on {rng.choice(DAYS)}?",
        f"Please say hello to your {rng.choice(RELATIVES)} for me.",
        f"Do you still have the {rng.choice(COLORS)} {rng.choice(THINGS)}, {friend.name}?",
    ]
    return sentences


def make_letter(rng: random.Random, target_words: int) -> str:
    """A short letter from one character to another; letters ignore `target_words`."""
    writer = pick_person(rng)
    friend = pick_person(rng, (writer,))
    body = [sentence for sentence in letter_sentences(rng, friend) if rng.random() < 0.8]
    closing = rng.choice(["Love,", "Your friend,", "See you soon,"])
    return f"Dear {friend.name},\n\n{' '.join(body)}\n\n{closing}\n{writer.name}"


DOCUMENT_KINDS: list[tuple[Callable[[random.Random, int], str], float]] = [
    (make_story, 0.26),
    (make_arithmetic, 0.12),
    (make_counting, 0.08),
    (make_lists, 0.10),
    (make_questions, 0.12),
    (make_dialogue, 0.14),
    (make_routine, 0.10),
    (make_letter, 0.08),
]


def make_document(rng: random.Random) -> str:
    """One document of MIN_WORDS to MAX_WORDS words, of a randomly chosen kind."""
    builders = [builder for builder, _ in DOCUMENT_KINDS]
    weights = [weight for _, weight in DOCUMENT_KINDS]
    while True:
        builder = rng.choices(builders, weights)[0]
        text = builder(rng, rng.randint(MIN_WORDS, MAX_WORDS - 100))
        if MIN_WORDS <= count_words(text) <= MAX_WORDS:
            return text


def split_rng(seed: int, split: str) -> random.Random:
    """An independent random stream per split; string seeds hash with SHA-512, not hash()."""
    return random.Random(f"smoke-corpus/{seed}/{split}")


def generate_split(rng: random.Random, target_bytes: int) -> str:
    """JSON Lines text of whole documents, as many as fit in `target_bytes` (at least one)."""
    lines: list[str] = []
    size = 0
    while True:
        line = json.dumps({"text": make_document(rng)}, ensure_ascii=False) + "\n"
        if lines and size + len(line.encode("utf-8")) > target_bytes:
            return "".join(lines)
        lines.append(line)
        size += len(line.encode("utf-8"))


def write_split(path: Path, seed: int, target_bytes: int) -> None:
    """Generate one split and write it to `path` with Unix newlines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = generate_split(split_rng(seed, path.stem), target_bytes)
    path.write_bytes(text.encode("utf-8"))
    documents = text.count("\n")
    print(f"wrote {path} ({len(text.encode('utf-8'))} bytes, {documents} documents)")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="folder for the two .jsonl files"
    )
    parser.add_argument("--train-bytes", type=int, default=DEFAULT_TRAIN_BYTES, help="train.jsonl size limit")
    parser.add_argument(
        "--val-bytes", type=int, default=DEFAULT_VAL_BYTES, help="validation.jsonl size limit"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of both random streams")
    args = parser.parse_args()
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir} is a file; give a folder")
    return args


def main() -> None:
    """Write train.jsonl and validation.jsonl into the output folder."""
    args = parse_args()
    write_split(args.out_dir / "train.jsonl", args.seed, args.train_bytes)
    write_split(args.out_dir / "validation.jsonl", args.seed, args.val_bytes)


if __name__ == "__main__":
    main()
