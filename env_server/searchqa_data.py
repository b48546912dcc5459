"""Generate SearchQA's shipped corpus and questions: a small made-up world, so that no model can
answer from memory and every answer has to be searched for.

    python -m env_server.searchqa_data  # rewrites env_server/data/searchqa_{corpus,qa}.jsonl

The world: towns (in a region, on a river), people (born in a town in a year, with an occupation),
companies (a founder, a founding year, a headquarters town) and inventions (an inventor, a year, a
manufacturer). Every fact is stated once, on its subject's own page, so a two-hop question ("In
which town was the founder of Zorvex Labs born?") needs two searches: the company's page names the
founder, the founder's page names the town. Names come in families that share a word ("Zorvex Labs"
and "Zorvex Motors", "Oriel Vantrask" and "Maren Vantrask", "Velmora" and "East Velmora"), so a
search returns look-alike pages next to the right one.

Output, one JSON object per line:
- corpus: {"id", "title", "text"};
- questions (FlashRAG's fields plus the expert's route): {"id", "question", "golden_answers",
  "data_source": "synthetic_1hop" | "synthetic_2hop", "hops": [{"query", "doc"}, ...]}, where each
  hop is the search the expert makes and the id of the page that answers it.

Everything is drawn from `random.Random(SEED)` over lists (never sets), so the files are the same
bytes on every machine; tests/test_searchqa.py regenerates them and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import random

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CORPUS_FILE, QA_FILE = "searchqa_corpus.jsonl", "searchqa_qa.jsonl"
SEED = 0
N_REGIONS, N_RIVERS, N_TOWNS, N_PEOPLE, N_COMPANIES, N_INVENTIONS = 8, 16, 48, 120, 60, 60
N_QUESTIONS = 180  # per data source

# Name parts. Onsets, vowels and codas make invented words; suffixes make them read as a kind of
# thing.
ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st",
          "t", "tr", "v", "z", "th", "h", "c", "sk", "w"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "x", "v", "sk", "nd", "rt", "m", "th"]
TOWN_ENDS = ["bury", "holm", "stead", "wick", "mora", "dale", "ford", "ton", "mere", "gate"]
REGION_ENDS = ["mark", "land", "ia", "shire"]
COMPANY_KINDS = ["Labs", "Works", "Motors", "Systems", "Industries", "Foundry"]
DEVICES = ["Loom", "Engine", "Lamp", "Press", "Pump", "Valve", "Compass", "Kiln", "Telegraph",
           "Lathe"]
QUARTERS = ["East", "West", "North", "South", "Upper", "Lower"]
OCCUPATIONS = ["chemist", "engineer", "clockmaker", "architect", "botanist", "cartographer",
               "glassblower", "physician", "metallurgist", "shipwright", "astronomer", "printer"]


class Names:
    """Invented words, each used once across the whole world (so only families share a word)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: int, end: str = "") -> str:
        while True:
            w = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables))
            w = (w + (end or self.rng.choice(CODAS))).capitalize()
            if w not in self.used and len(w) >= 4:
                self.used.add(w)
                return w


# --------------------------------------------------------------------------------------------------
# The world
# --------------------------------------------------------------------------------------------------
def make_world(rng: random.Random) -> dict:
    names = Names(rng)
    regions = [names.word(2, rng.choice(REGION_ENDS)) for _ in range(N_REGIONS)]
    rivers = [names.word(2) + " River" for _ in range(N_RIVERS)]

    towns = []
    while len(towns) < N_TOWNS:
        if towns and rng.random() < 0.2:  # "East Velmora" next to "Velmora"
            base = rng.choice([t for t in towns if " " not in t["name"]])["name"]
            name = f"{rng.choice(QUARTERS)} {base}"
            if any(t["name"] == name for t in towns):
                continue
        else:
            name = names.word(rng.choice([1, 2]), rng.choice(TOWN_ENDS))
        towns.append({"name": name, "region": rng.choice(regions), "river": rng.choice(rivers)})

    people = []
    while len(people) < N_PEOPLE:
        r = rng.random()
        if people and r < 0.3:  # a relative: same surname
            first, last = names.word(2), rng.choice(people)["last"]
        elif people and r < 0.45:  # a namesake: same first name
            first, last = rng.choice(people)["first"], names.word(rng.choice([2, 3]))
        else:
            first, last = names.word(2), names.word(rng.choice([2, 3]))
        if any(p["first"] == first and p["last"] == last for p in people):
            continue
        people.append({"name": f"{first} {last}", "first": first, "last": last,
                       "town": rng.choice(towns)["name"], "year": rng.randint(1780, 1900),
                       "occupation": rng.choice(OCCUPATIONS)})

    companies = []
    founders = rng.sample(people, N_COMPANIES)  # one company per founder
    while len(companies) < N_COMPANIES:
        if companies and rng.random() < 0.35:  # "Zorvex Motors" next to "Zorvex Labs"
            stem = rng.choice(companies)["stem"]
        else:
            stem = names.word(2)
        name = f"{stem} {rng.choice(COMPANY_KINDS)}"
        if any(c["name"] == name for c in companies):
            continue
        founder = founders[len(companies)]
        companies.append({"name": name, "stem": stem, "founder": founder["name"],
                          "year": founder["year"] + rng.randint(22, 50),
                          "hq": rng.choice(towns)["name"]})

    inventions = []
    while len(inventions) < N_INVENTIONS:
        if inventions and rng.random() < 0.35:  # "Brindle Lamp" next to "Brindle Loom"
            stem = rng.choice(inventions)["stem"]
        else:
            stem = names.word(rng.choice([1, 2]))
        name = f"{stem} {rng.choice(DEVICES)}"
        if any(i["name"] == name for i in inventions):
            continue
        inventor = rng.choice(people)
        inventions.append({"name": name, "stem": stem, "inventor": inventor["name"],
                           "year": inventor["year"] + rng.randint(20, 45),
                           "maker": rng.choice(companies)["name"]})
    return {"towns": towns, "people": people, "companies": companies, "inventions": inventions}


def pages(world: dict, rng: random.Random) -> list[dict]:
    """One page per entity, in a shuffled order (so a page's id says nothing about its kind)."""
    out = []
    for t in world["towns"]:
        n, r, v = t["name"], t["region"], t["river"]
        out.append((n, rng.choice([
            f"{n} is a town in the {r} region. The {v} flows through {n}, and the town grew up "
            f"around its river mills.",
            f"The {v} flows through {n}, a market town in the {r} region known for its stone "
            "bridges.",
        ])))
    for p in world["people"]:
        n, last, t, y = p["name"], p["last"], p["town"], p["year"]
        o = ("an " if p["occupation"][0] in "aeiou" else "a ") + p["occupation"]
        out.append((n, rng.choice([
            f"{n} was {o} born in {t} in {y}. {last} kept detailed notebooks throughout a long "
            "career.",
            f"{n} (born {y} in {t}) was {o}. Colleagues described {last} as patient and exacting.",
        ])))
    for c in world["companies"]:
        n, f, y, hq = c["name"], c["founder"], c["year"], c["hq"]
        out.append((n, rng.choice([
            f"{n} is a company headquartered in {hq}. It was founded in {y} by {f}, its founder "
            f"and first director.",
            f"{n} was founded in {y}. Its founder was {f}. The company is headquartered in {hq}.",
        ])))
    for i in world["inventions"]:
        n, who, y, m = i["name"], i["inventor"], i["year"], i["maker"]
        out.append((n, rng.choice([
            f"The {n} is a machine invented by {who} in {y}. Today it is manufactured by {m}.",
            f"{who} invented the {n} in {y}. The {n} is manufactured by {m} and sold across the "
            "region.",
        ])))
    rng.shuffle(out)
    return [{"id": f"d{k:04d}", "title": title, "text": text}
            for k, (title, text) in enumerate(out)]


# --------------------------------------------------------------------------------------------------
# Questions
# --------------------------------------------------------------------------------------------------
def aliases(kind: str, value, people: list[dict]) -> list[str]:
    """Gold answers: the name as written, then forms a reader may fairly give instead."""
    if kind == "person":
        first, last = value.split(" ", 1)
        # "O. Vantrask" only where no relative shares the initial: an alias must name one person
        if sum(p["last"] == last and p["first"][0] == first[0] for p in people) == 1:
            return [value, f"{first[0]}. {last}"]
    if kind == "company" and value.endswith(" Labs"):
        return [value, value[: -len("Labs")] + "Laboratories"]
    if kind == "river":
        return [value, value[: -len(" River")]]
    if kind == "region":
        return [value, f"{value} region"]
    return [str(value)]


def make_questions(world: dict, docs: list[dict], rng: random.Random) -> list[dict]:
    doc_of = {d["title"]: d["id"] for d in docs}
    by = {k: {e["name"]: e for e in world[k]} for k in world}
    person, company, town = by["people"], by["companies"], by["towns"]

    def hop(name: str, keyword: str) -> dict:
        return {"query": f"{name} {keyword}", "doc": doc_of[name]}

    # Each kind: (entity list, question template, lambda entity -> (hops, answer kind, answer)).
    one_hop = [
        ("people", "In which town was {} born?",
         lambda e: ([hop(e["name"], "born")], "town", e["town"])),
        ("people", "In what year was {} born?",
         lambda e: ([hop(e["name"], "born")], "year", e["year"])),
        ("people", "What was the occupation of {}?",
         lambda e: ([hop(e["name"], "occupation")], "job", e["occupation"])),
        ("companies", "Who founded {}?",
         lambda e: ([hop(e["name"], "founder")], "person", e["founder"])),
        ("companies", "In what year was {} founded?",
         lambda e: ([hop(e["name"], "founded")], "year", e["year"])),
        ("companies", "In which town is {} headquartered?",
         lambda e: ([hop(e["name"], "headquartered")], "town", e["hq"])),
        ("inventions", "Who invented the {}?",
         lambda e: ([hop(e["name"], "invented")], "person", e["inventor"])),
        ("inventions", "Which company manufactures the {}?",
         lambda e: ([hop(e["name"], "manufactured")], "company", e["maker"])),
        ("inventions", "In what year was the {} invented?",
         lambda e: ([hop(e["name"], "invented")], "year", e["year"])),
        ("towns", "Which river flows through {}?",
         lambda e: ([hop(e["name"], "river")], "river", e["river"])),
        ("towns", "In which region is {}?",
         lambda e: ([hop(e["name"], "region")], "region", e["region"])),
    ]

    def founder(c):
        return person[c["founder"]]

    def inventor(i):
        return person[i["inventor"]]

    def maker(i):
        return company[i["maker"]]

    def hq(c):
        return town[c["hq"]]

    def birthplace(p):
        return town[p["town"]]

    two_hop = [
        ("companies", "In which town was the founder of {} born?",
         lambda e: ([hop(e["name"], "founder"), hop(e["founder"], "born")], "town",
                    founder(e)["town"])),
        ("companies", "In what year was the founder of {} born?",
         lambda e: ([hop(e["name"], "founder"), hop(e["founder"], "born")], "year",
                    founder(e)["year"])),
        ("companies", "Which river flows through the town where {} is headquartered?",
         lambda e: ([hop(e["name"], "headquartered"), hop(e["hq"], "river")], "river",
                    hq(e)["river"])),
        ("companies", "In which region is the headquarters of {}?",
         lambda e: ([hop(e["name"], "headquartered"), hop(e["hq"], "region")], "region",
                    hq(e)["region"])),
        ("inventions", "In which town was the inventor of the {} born?",
         lambda e: ([hop(e["name"], "invented"), hop(e["inventor"], "born")], "town",
                    inventor(e)["town"])),
        ("inventions", "What was the occupation of the inventor of the {}?",
         lambda e: ([hop(e["name"], "invented"), hop(e["inventor"], "occupation")], "job",
                    inventor(e)["occupation"])),
        ("inventions", "Who founded the company that manufactures the {}?",
         lambda e: ([hop(e["name"], "manufactured"), hop(e["maker"], "founder")], "person",
                    maker(e)["founder"])),
        ("inventions", "In which town is the manufacturer of the {} headquartered?",
         lambda e: ([hop(e["name"], "manufactured"), hop(e["maker"], "headquartered")], "town",
                    maker(e)["hq"])),
        ("people", "Which river flows through the birthplace of {}?",
         lambda e: ([hop(e["name"], "born"), hop(e["town"], "river")], "river",
                    birthplace(e)["river"])),
        ("people", "In which region was {} born?",
         lambda e: ([hop(e["name"], "born"), hop(e["town"], "region")], "region",
                    birthplace(e)["region"])),
    ]

    rows = []
    for source, kinds in (("synthetic_1hop", one_hop), ("synthetic_2hop", two_hop)):
        # Kinds take turns; each kind draws its entities without replacement, in a shuffled order.
        queues = [rng.sample(world[k], len(world[k])) for k, _, _ in kinds]
        for n in range(N_QUESTIONS):
            k = n % len(kinds)
            entity = queues[k].pop()
            _, template, route = kinds[k]
            hops, kind, answer = route(entity)
            rows.append({"id": f"q{len(rows):04d}", "question": template.format(entity["name"]),
                         "golden_answers": aliases(kind, answer, world["people"]),
                         "data_source": source, "hops": hops})
    return rows


def generate(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    world = make_world(rng)
    docs = pages(world, rng)
    return docs, make_questions(world, docs, rng)


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DATA_DIR,
                   help="folder to write the two files to (default: %(default)s)")
    p.add_argument("--seed", type=int, default=SEED,
                   help="generator seed (the shipped files use %(default)s)")
    args = p.parse_args(argv)
    docs, questions = generate(args.seed)
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, CORPUS_FILE), docs)
    write_jsonl(os.path.join(args.out, QA_FILE), questions)
    print(f"wrote {len(docs)} passages to {CORPUS_FILE} and {len(questions)} questions to "
          f"{QA_FILE} in {args.out}")


if __name__ == "__main__":
    main()
