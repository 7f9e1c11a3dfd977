#!/usr/bin/env python3
"""Write data/squad_sample.json: a few hundred generated question/answer pairs in SQuAD v1.1 format."""
# The paragraphs describe invented towns, people, devices, festivals and animals built from templates,
# so the bundled sample holds no copied SQuAD text and is reproducible byte for byte from a seed.
import hashlib
import json
import random
import sys
from pathlib import Path

from trace_tools.atomic import write_text_atomic
from trace_tools.command_line import ArgumentParser

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "data" / "squad_sample.json"

SYLLABLES = ["ka", "lo", "ven", "mar", "is", "tel", "ro", "dan", "fi", "sa", "nor", "bel", "ul", "gar",
             "en", "mi", "tor", "al", "wyn", "es", "dor", "qui", "la", "bran", "ost", "el", "vik", "ha"]
GIVEN_NAMES = ["Ada", "Bram", "Celia", "Doran", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira",
               "Lucan", "Mira", "Nils", "Oona", "Pavel", "Rhea", "Soren", "Talia", "Ugo", "Vera", "Wim"]
PROVINCES = ["North Vale", "the Eastern Reach", "Lower Marsh", "the High Plateau", "West Fen", "the Coastal March"]
PROFESSIONS = ["ferryman", "stonemason", "miller", "salt trader", "weaver", "clockmaker", "boat builder"]
REASONS = ["wanted a safe crossing for merchants", "found clay suited to bricks nearby",
           "needed water power for a mill", "was granted the land by a local council"]
PRODUCTS = ["smoked cheese", "blue glassware", "woollen blankets", "pear cider", "copper kettles", "rye bread"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
BUILDINGS = ["old toll house", "granary", "bell tower", "river mill", "guild hall", "chapel of the bridge"]
MATERIALS = ["grey limestone", "red brick", "oak timber", "river cobbles", "sandstone blocks"]
FIELDS = ["chemistry", "astronomy", "botany", "geology", "acoustics", "optics", "hydrology"]
NATIONALITIES = ["Norvaric", "Estlandic", "Maravian", "Ostrelian", "Valdish", "Corvenian"]
PHENOMENA = {
    "chemistry": "salts dissolve faster in moving water",
    "astronomy": "faint stars change brightness over long cycles",
    "botany": "mosses spread across bare rock",
    "geology": "river gravel sorts itself by size",
    "acoustics": "sound bends around tall buildings",
    "optics": "thin films of oil split light into colours",
    "hydrology": "groundwater rises after a dry summer",
}
THINGS = ["rule", "curve", "constant", "principle", "effect"]
PRIZES = ["Halden Medal", "Orrin Prize", "Silver Compass Award", "Linden Medal"]
DEVICE_KINDS = ["mechanical", "hydraulic", "electric", "clockwork", "pneumatic"]
PARTS = ["gears", "valves", "brass rollers", "springs", "copper coils"]
PURPOSES = ["sort letters by weight", "measure rainfall", "count passing carts", "wind thread onto spools",
            "pump water from mines", "press grapes for juice"]
SECTORS = ["farming", "mining", "the postal service", "textile mills", "shipping"]
EVENTS = ["a new railway line opened", "the price of steel fell", "a national exhibition showed it",
          "the guild approved its use", "a flood destroyed older machines"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
GROUPS = ["fishermen", "farmers", "street musicians", "bakers", "students", "lantern makers"]
MAIN_EVENTS = ["lantern parade", "boat race", "drum procession", "kite contest", "horse show"]
STREETS = ["Harbour Road", "Mill Lane", "Bridge Street", "Market Row", "Canal Walk"]
FOODS = ["honey cakes", "fish soup", "roasted chestnuts", "plum dumplings", "barley stew"]
ORGS = ["town library", "lifeboat station", "music school", "children's hospital", "river trust"]
ANIMAL_CLASSES = ["beetle", "frog", "songbird", "freshwater fish", "bat", "lizard"]
REGIONS = ["northern wetlands", "southern pine forests", "eastern highlands", "western dunes", "central lakes"]
DIETS = ["small snails", "fallen seeds", "mosquito larvae", "wild berries", "moths"]
STATUSES = ["vulnerable", "near threatened", "endangered", "of least concern"]
THREATS = ["draining of marshes", "forest clearing", "road traffic", "warmer summers", "river pollution"]


def invented_name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def person(rng: random.Random) -> str:
    return f"{rng.choice(GIVEN_NAMES)} {invented_name(rng, 3)}"


def town_paragraph(rng: random.Random):
    town, river = invented_name(rng, 3), invented_name(rng, 2)
    year, pop = rng.randint(1100, 1800), rng.randint(2, 90) * 1000 + rng.randint(1, 999)
    founder, profession, reason = person(rng), rng.choice(PROFESSIONS), rng.choice(REASONS)
    product, day = rng.choice(PRODUCTS), rng.choice(DAYS)
    building, material, province = rng.choice(BUILDINGS), rng.choice(MATERIALS), rng.choice(PROVINCES)
    context = (
        f"{town} is a market town on the banks of the {river} River in {province}. "
        f"It was founded in {year} by {founder}, a {profession} who {reason}. "
        f"The town is known for its {product}, which is sold at a market held every {day}. "
        f"About {pop:,} people lived in {town} at the last census. "
        f"Its oldest surviving structure is the {building}, built from {material}."
    )
    qas = [
        (f"On which river does {town} stand?", f"{river} River"),
        (f"In what year was {town} founded?", str(year)),
        (f"Who founded {town}?", founder),
        (f"What product is {town} known for?", product),
        (f"On which day of the week is the market held in {town}?", day),
        (f"How many people lived in {town} at the last census?", f"{pop:,}"),
        (f"What is the {building} in {town} built from?", material),
    ]
    return town, context, qas


def scientist_paragraph(rng: random.Random):
    name, field, nationality = person(rng), rng.choice(FIELDS), rng.choice(NATIONALITIES)
    surname = name.split()[1]
    born = rng.randint(1780, 1930)
    prize_year = born + rng.randint(30, 60)
    city, city2, univ = invented_name(rng, 2), invented_name(rng, 3), f"University of {invented_name(rng, 2)}"
    mentor, thing, prize, staff = person(rng), rng.choice(THINGS), rng.choice(PRIZES), rng.randint(5, 60)
    context = (
        f"{name} was a {nationality} researcher in {field}, born in {born} in the city of {city}. "
        f"{surname} studied at the {univ}, working under the supervision of {mentor}. "
        f"The best-known result of this work, the {surname} {thing}, describes how {PHENOMENA[field]}. "
        f"In {prize_year} {surname} received the {prize} for it. "
        f"Later {surname} moved to {city2} and led a laboratory of {staff} researchers there."
    )
    qas = [
        (f"In which field did {name} work?", field),
        (f"Where was {name} born?", city),
        (f"At which university did {surname} study?", univ),
        (f"Who supervised {surname}?", mentor),
        (f"What does the {surname} {thing} describe?", PHENOMENA[field]),
        (f"Which award did {surname} receive in {prize_year}?", prize),
        (f"How many researchers were in the laboratory {surname} led?", str(staff)),
    ]
    return name, context, qas


def device_paragraph(rng: random.Random):
    device = f"{invented_name(rng, 2)} {rng.choice(['engine', 'press', 'sorter', 'gauge'])}"
    company, city = f"{invented_name(rng, 2)} Works", invented_name(rng, 3)
    year = rng.randint(1820, 1950)
    year2 = year + rng.randint(5, 40)
    kind, parts, purpose, n = rng.choice(DEVICE_KINDS), rng.choice(PARTS), rng.choice(PURPOSES), rng.randint(3, 40)
    weight, weight2 = rng.randint(200, 900), rng.randint(20, 150)
    sector, event = rng.choice(SECTORS), rng.choice(EVENTS)
    context = (
        f"The {device} is a {kind} machine first built in {year} by engineers at {company} in {city}. "
        f"It uses {n} {parts} to {purpose}. "
        f"Early versions weighed about {weight} kilograms, while later models weighed only {weight2} kilograms. "
        f"The machine became common in {sector} after {year2}, when {event}."
    )
    qas = [
        (f"When was the {device} first built?", str(year)),
        (f"Which company built the first {device}?", company),
        (f"What is the {device} used for?", purpose),
        (f"How many {parts} does the {device} use?", str(n)),
        (f"How much did early versions of the {device} weigh?", f"about {weight} kilograms"),
        (f"In which sector did the {device} become common?", sector),
    ]
    return device, context, qas


def festival_paragraph(rng: random.Random):
    fest, town, month = f"{invented_name(rng, 2)} Festival", invented_name(rng, 3), rng.choice(MONTHS)
    year, visitors = rng.randint(1850, 1990), rng.randint(3, 250) * 1000
    group, event, street = rng.choice(GROUPS), rng.choice(MAIN_EVENTS), rng.choice(STREETS)
    food, org = rng.choice(FOODS), rng.choice(ORGS)
    context = (
        f"The {fest} takes place every {month} in the town of {town}. "
        f"It began in {year} as a small gathering of {group} and now attracts about {visitors:,} visitors. "
        f"The main event is a {event} along {street}, followed by {food} served in the central square. "
        f"Money raised during the festival supports the {org}."
    )
    qas = [
        (f"In which month does the {fest} take place?", month),
        (f"Where is the {fest} held?", town),
        (f"When did the {fest} begin?", str(year)),
        (f"Who started the {fest}?", group),
        (f"What is the main event of the {fest}?", event),
        (f"What food is served after the main event of the {fest}?", food),
        (f"What does the money raised by the {fest} support?", f"the {org}"),
    ]
    return fest, context, qas


def animal_paragraph(rng: random.Random):
    cls, region = rng.choice(ANIMAL_CLASSES), rng.choice(REGIONS)
    animal = f"{invented_name(rng, 2)} {cls}"
    length, diet, year = rng.randint(2, 60), rng.choice(DIETS), rng.randint(1750, 1990)
    naturalist, status, threat = person(rng), rng.choice(STATUSES), rng.choice(THREATS)
    context = (
        f"The {animal} is a {cls} found only in the {region}. "
        f"Adults grow to about {length} centimetres in length and feed mainly on {diet}. "
        f"It was first described in {year} by the naturalist {naturalist}. "
        f"Today the species is considered {status}, mostly because of {threat}."
    )
    qas = [
        (f"Where is the {animal} found?", f"the {region}"),
        (f"How long do adults of the {animal} grow?", f"about {length} centimetres"),
        (f"What does the {animal} mainly eat?", diet),
        (f"Who first described the {animal}?", naturalist),
        (f"In what year was the {animal} first described?", str(year)),
        (f"Why is the {animal} considered {status}?", threat),
    ]
    return animal, context, qas


TOPICS = [town_paragraph, scientist_paragraph, device_paragraph, festival_paragraph, animal_paragraph]


def build_sample(paragraphs_per_topic: int, seed: int) -> dict:
    """SQuAD v1.1 structure: one article per paragraph; each answer is the single occurrence of its text."""
    rng = random.Random(seed)
    articles = []
    for index in range(paragraphs_per_topic * len(TOPICS)):
        make = TOPICS[index % len(TOPICS)]
        while True:
            title, context, qas = make(rng)
            # Redraw a paragraph whose answer text is ambiguous (appears twice), so answer_start is unique.
            if all(context.count(answer) == 1 for _, answer in qas):
                break
        entries = []
        for question, answer in qas:
            qid = hashlib.sha1(f"{title}|{question}".encode()).hexdigest()[:24]
            entries.append({"id": qid, "question": question,
                            "answers": [{"text": answer, "answer_start": context.index(answer)}]})
        articles.append({"title": title, "paragraphs": [{"context": context, "qas": entries}]})
    return {"version": "1.1", "data": articles}


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write (default: %(default)s)")
    parser.add_argument("--paragraphs-per-topic", type=int, default=12,
                        help="paragraphs per template topic; 5 topics, 6-7 questions each (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=20240601, help="random seed (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.paragraphs_per_topic < 1:
        parser.error("--paragraphs-per-topic must be at least 1")
    sample = build_sample(args.paragraphs_per_topic, args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.output, json.dumps(sample, indent=1, ensure_ascii=False) + "\n")
    n_questions = sum(len(p["qas"]) for a in sample["data"] for p in a["paragraphs"])
    print(f"wrote {args.output}: {len(sample['data'])} paragraphs, {n_questions} question/answer pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
