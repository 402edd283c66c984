"""A generated knowledge base of fictional entities and multi-hop questions over it.

Where this sits: the Search-R1-style task (`envs/search_qa.py`) searches these documents with
BM25 (`tools/search.py`) and asks these questions. Every name is invented from syllables, so no
model can know a fact without retrieving it: the task measures searching, not recall.

The world (`generate_world`), from one seed:

* countries, each with several cities, one of them its capital;
* universities, each in a city;
* people, each born in a city, educated at a university, with an occupation and birth year;
* companies, each founded by a person and headquartered in a city.

Each entity has one document that states its own facts (a person's document says where they
were born; a city's document says its country). A question follows a chain of functional
relations from a start entity, e.g. company -founder-> person -birth_city-> city -country->
country: "In which country was the founder of Quorvel Systems born?". Hop i is answered by the
document of the entity reached after i - 1 hops, found by searching that entity's name.

Difficulty knobs (`KBConfig`): `min_hops` / `max_hops`, and `distractors`, which adds per
document that many sentences mentioning unrelated entities (so a name query also matches other
documents), confusable facts (where a person later moved, a company's branch office), and
families of people sharing a surname.

Storage: `SearchQAKB`, a `tfds.core.GeneratorBasedBuilder` writing ArrayRecord files with splits
"documents", "train", "eval" and "sft"; `load_kb` prepares it once under a data dir and reads
it back through `builder.as_data_source()`, a batch of records a read. Neither step needs
TensorFlow.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import random
import re
from typing import Any, Sequence

import numpy as np
import tensorflow_datasets as tfds

from jaxagent.tools.search import Document

SPLITS = ("train", "eval", "sft")
_VERSION = "1.0.0"

# ----------------------------------------------------------------------------- relations
# name -> (source type, target type, what the searcher needs, the fact once found)
RELATIONS = {
    "birth_city": ("person", "city", "where {x} was born", "{x} was born in {y}"),
    "alma_mater": ("person", "university", "which university {x} attended",
                   "{x} studied at {y}"),
    "country": ("city", "country", "which country {x} is in", "{x} is a city in {y}"),
    "capital": ("country", "city", "the capital of {x}", "the capital of {x} is {y}"),
    "university_city": ("university", "city", "where {x} is located",
                        "{x} is a university located in {y}"),
    "founder": ("company", "person", "who founded {x}", "{x} was founded by {y}"),
    "headquarters": ("company", "city", "where {x} is headquartered",
                     "{x} is headquartered in {y}"),
}

# (relation chain, question about the start entity `{e}`)
TEMPLATES = (
    (("birth_city",), "In which city was {e} born?"),
    (("alma_mater",), "Which university did {e} attend?"),
    (("country",), "In which country is the city of {e}?"),
    (("capital",), "What is the capital of {e}?"),
    (("university_city",), "In which city is {e} located?"),
    (("founder",), "Who founded {e}?"),
    (("headquarters",), "In which city is {e} headquartered?"),
    (("birth_city", "country"), "In which country was {e} born?"),
    (("founder", "birth_city"), "In which city was the founder of {e} born?"),
    (("founder", "alma_mater"), "Which university did the founder of {e} attend?"),
    (("headquarters", "country"), "In which country is {e} headquartered?"),
    (("alma_mater", "university_city"), "In which city is the university that {e} attended?"),
    (("university_city", "country"), "In which country is {e} located?"),
    (("country", "capital"), "What is the capital of the country where {e} is located?"),
    (("founder", "birth_city", "country"), "In which country was the founder of {e} born?"),
    (("birth_city", "country", "capital"),
     "What is the capital of the country where {e} was born?"),
    (("headquarters", "country", "capital"),
     "What is the capital of the country where {e} is headquartered?"),
    (("alma_mater", "university_city", "country"),
     "In which country is the university that {e} attended?"),
    (("founder", "alma_mater", "university_city"),
     "In which city is the university attended by the founder of {e}?"),
    (("founder", "birth_city", "country", "capital"),
     "What is the capital of the country where the founder of {e} was born?"),
    (("founder", "alma_mater", "university_city", "country"),
     "In which country is the university attended by the founder of {e}?"),
)
MAX_HOPS = max(len(chain) for chain, _ in TEMPLATES)

_OCCUPATIONS = ("painter", "engineer", "botanist", "composer", "architect", "chemist", "poet",
                "cartographer", "economist", "sculptor", "astronomer", "novelist")
_INDUSTRIES = ("shipping", "textile", "software", "mining", "publishing", "aviation", "glassware",
               "pharmaceutical", "farming", "telescope")
_COMPANY_SUFFIX = ("Systems", "Works", "Holdings", "Labs", "Trading", "Foundry", "Industries")
_UNIVERSITY_FORM = ("{w} University", "University of {w}", "{w} Institute", "{w} College")
_FILLER = (
    "{x} is mentioned in several regional almanacs.",
    "Little else about {x} appears in the archives.",
    "Records about {x} were catalogued in a later survey.",
    "Travellers' letters describe {x} only briefly.",
)
_MENTIONS = (
    "{x} is sometimes confused with {z}.",
    "A guidebook lists {x} next to {z}.",
    "Visitors who read about {x} often read about {z} as well.",
    "An old newspaper printed a story about {x} beside one about {z}.",
)
_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "pr",
           "r", "s", "st", "t", "tr", "th", "v", "z", "qu", "sh", "y", "w")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou", "ia", "ae")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "k", "nd", "rn", "x", "sk", "v")


@dataclasses.dataclass(frozen=True)
class KBConfig:
  """What to generate; every field, and the generator's code, enter the dataset's name, so
  equal configs share files under one version of the generator.

  Attributes:
    seed: seed of the world and the questions.
    num_countries, num_cities, num_universities, num_people, num_companies: entity counts.
    min_hops, max_hops: hop range of the questions (1 to 4); hop counts are balanced.
    distractors: per document, that many unrelated mentions of other entities; at >= 1 also
      confusable facts (where a person moved later, a company's branch office) and families of
      up to three people sharing a surname.
    train_size, eval_size, sft_size: questions per split (disjoint: no (template, start entity)
      pair is asked in two splits).
  """

  seed: int = 0
  num_countries: int = 8
  num_cities: int = 40
  num_universities: int = 20
  num_people: int = 240
  num_companies: int = 160
  min_hops: int = 1
  max_hops: int = 3
  distractors: int = 1
  train_size: int = 2000
  eval_size: int = 200
  sft_size: int = 256

  def __post_init__(self):
    for field in dataclasses.fields(self):  # every field is a count (a float such as 1e3 too)
      v = getattr(self, field.name)
      if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"KBConfig.{field.name} must be an int, got {v!r} "
                         f"({type(v).__name__})")
    for name in ("seed", "distractors", "train_size", "eval_size", "sft_size"):
      v = getattr(self, name)
      if v < 0:
        raise ValueError(f"KBConfig.{name} must be an int >= 0, got {v!r}")
    if not 1 <= self.num_countries:
      raise ValueError(f"KBConfig.num_countries must be >= 1, got {self.num_countries}")
    if self.num_cities < 2 * self.num_countries:
      raise ValueError(f"KBConfig.num_cities must be >= 2 * num_countries (every country needs a "
                       f"capital and another city), got {self.num_cities} for "
                       f"{self.num_countries} countries")
    for name in ("num_universities", "num_people", "num_companies"):
      if getattr(self, name) < 1:
        raise ValueError(f"KBConfig.{name} must be >= 1, got {getattr(self, name)}")
    if not 1 <= self.min_hops <= self.max_hops <= MAX_HOPS:
      raise ValueError(f"KBConfig needs 1 <= min_hops <= max_hops <= {MAX_HOPS}, got "
                       f"min_hops={self.min_hops}, max_hops={self.max_hops}")

  @property
  def dataset_name(self) -> str:
    """The builder config name: a digest of every field and of the generator's code (this
    file), so a prepared dataset written by another version of the generator is not read
    back as this version's world."""
    blob = json.dumps([dataclasses.asdict(self), _generator_digest()], sort_keys=True).encode()
    return f"kb_{hashlib.sha1(blob).hexdigest()[:12]}"


@functools.lru_cache(maxsize=None)
def _generator_digest() -> str:
  """sha1 of this module's source, which generates the world, questions and documents."""
  return hashlib.sha1(pathlib.Path(__file__).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- the world
@dataclasses.dataclass
class Entity:
  """One fictional entity: its type, name, document id and outgoing relations."""

  kind: str
  name: str
  doc_id: str
  relations: dict[str, int] = dataclasses.field(default_factory=dict)  # relation -> entity index
  attributes: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class World:
  """All entities (indexed by position) and their documents (same order)."""

  entities: list[Entity]
  documents: list[Document]

  def by_kind(self, kind: str) -> list[int]:
    return [i for i, e in enumerate(self.entities) if e.kind == kind]


@dataclasses.dataclass(frozen=True)
class Question:
  """A multi-hop question with its gold answer and the path that answers it.

  Attributes:
    queries: the search query of each hop (the name of the entity the hop starts from).
    supporting_ids, supporting_titles: the document that answers each hop.
    hop_answers: the entity each hop reaches; the last is the answer.
    relations: the relation followed at each hop (keys of `RELATIONS`).
  """

  id: str
  question: str
  answers: tuple[str, ...]
  relations: tuple[str, ...]
  queries: tuple[str, ...]
  hop_answers: tuple[str, ...]
  supporting_ids: tuple[str, ...]
  supporting_titles: tuple[str, ...]

  @property
  def hops(self) -> int:
    return len(self.relations)


class _Names:
  """Unique invented words: no word is handed out twice."""

  def __init__(self, rng: random.Random):
    self.rng = rng
    self.used: set[str] = set()

  def word(self, syllables: tuple[int, int] = (2, 2)) -> str:
    for _ in range(10_000):
      n = self.rng.randint(*syllables)
      w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                  for _ in range(n)).capitalize()
      if 4 <= len(w) <= 9 and w.lower() not in self.used:
        self.used.add(w.lower())
        return w
    raise RuntimeError("ran out of invented names; lower the KBConfig entity counts")


def generate_world(cfg: KBConfig) -> World:
  """The entities and documents of `cfg` (deterministic in `cfg.seed`)."""
  rng = random.Random(f"world-{cfg.seed}")
  names = _Names(rng)
  ents: list[Entity] = []

  def add(kind: str, name: str, **attributes) -> int:
    ents.append(Entity(kind, name, f"{kind}-{len(ents)}", attributes=attributes))
    return len(ents) - 1

  countries = [add("country", names.word()) for _ in range(cfg.num_countries)]
  cities = [add("city", names.word(), population=rng.randrange(20, 2000) * 1000)
            for _ in range(cfg.num_cities)]
  for j, c in enumerate(cities):  # two cities per country first, then at random
    first_two = j < 2 * len(countries)
    ents[c].relations["country"] = countries[j // 2] if first_two else rng.choice(countries)
  for k in countries:
    ents[k].relations["capital"] = rng.choice(
        [c for c in cities if ents[c].relations["country"] == k])
  unis = [add("university", rng.choice(_UNIVERSITY_FORM).format(w=names.word()),
              founded=rng.randrange(1400, 1990)) for _ in range(cfg.num_universities)]
  for u in unis:
    ents[u].relations["university_city"] = rng.choice(cities)
  family = min(cfg.distractors, 2) + 1
  surname = ""
  people = []
  for i in range(cfg.num_people):
    if i % family == 0:
      surname = names.word()
    p = add("person", f"{names.word()} {surname}", occupation=rng.choice(_OCCUPATIONS),
            born=rng.randrange(1850, 1960))
    ents[p].relations.update(birth_city=rng.choice(cities), alma_mater=rng.choice(unis))
    people.append(p)
  for _ in range(cfg.num_companies):
    c = add("company", f"{names.word()} {rng.choice(_COMPANY_SUFFIX)}",
            industry=rng.choice(_INDUSTRIES))
    founder = rng.choice(people)
    ents[c].attributes["founded"] = ents[founder].attributes["born"] + rng.randrange(25, 60)
    ents[c].relations.update(founder=founder, headquarters=rng.choice(cities))
  docs = [Document(title=e.name, text=_document_text(i, ents, cities, cfg, rng), id=e.doc_id)
          for i, e in enumerate(ents)]
  return World(ents, docs)


def _document_text(i: int, ents: list[Entity], city_ids: list[int], cfg: KBConfig,
                   rng: random.Random) -> str:
  """The facts of entity `i` in prose, with `cfg.distractors` distractor sentences."""
  e, a, r = ents[i], ents[i].attributes, ents[i].relations
  name = lambda rel: ents[r[rel]].name  # noqa: E731
  if e.kind == "country":
    cities = [ents[c].name for c in city_ids if ents[c].relations["country"] == i]
    facts = [f"{e.name} is a country. The capital of {e.name} is {name('capital')}.",
             f"Cities of {e.name} include {', '.join(sorted(cities)[:4])}."]
  elif e.kind == "city":
    facts = [f"{e.name} is a city in {name('country')}.",
             f"{e.name} has a population of about {a['population']:,}."]
  elif e.kind == "university":
    facts = [f"{e.name} is a university located in {name('university_city')}.",
             f"{e.name} was founded in {a['founded']}."]
  elif e.kind == "person":
    article = "an" if a["occupation"][0] in "aeiou" else "a"
    facts = [f"{e.name} (born {a['born']}) is {article} {a['occupation']}.",
             f"{e.name} was born in {name('birth_city')}.",
             f"{e.name} studied at {name('alma_mater')}."]
    if cfg.distractors:
      moved = _other_city(rng, city_ids, r["birth_city"])
      facts.append(f"Later in life, {e.name} moved to {ents[moved].name}.")
  else:  # company
    article = "an" if a["industry"][0] in "aeiou" else "a"
    facts = [f"{e.name} was founded by {name('founder')} in {a['founded']}.",
             f"{e.name} is headquartered in {name('headquarters')}.",
             f"It is {article} {a['industry']} company."]
    if cfg.distractors:
      branch = _other_city(rng, city_ids, r["headquarters"])
      facts.append(f"{e.name} also runs a branch office in {ents[branch].name}.")
  extra = [rng.choice(_FILLER).format(x=e.name)]
  # Positions among the other entities (all but i), drawn as from a list of them; building that
  # list for every document made generation quadratic in the entity count.
  n_others = len(ents) - 1
  for j in rng.sample(range(n_others), min(cfg.distractors, n_others)):
    extra.append(rng.choice(_MENTIONS).format(x=e.name, z=ents[j + (j >= i)].name))
  return " ".join(facts + extra)


def _other_city(rng: random.Random, city_ids: list[int], city: int) -> int:
  """A random city of `city_ids` (ascending) other than `city`: the draw of `rng.choice` from
  the list without it, made without building that list for every document."""
  k = rng.randrange(len(city_ids) - 1)  # what `choice` draws from a list one shorter
  return city_ids[k + (k >= bisect.bisect_left(city_ids, city))]


def generate_questions(world: World, cfg: KBConfig) -> dict[str, list[Question]]:
  """Questions per split (`SPLITS`), hop counts and templates balanced round robin.

  Raises ValueError when the world has fewer distinct questions than the splits ask for.
  """
  rng = random.Random(f"questions-{cfg.seed}")
  ents = world.entities
  pools: dict[int, list[list[tuple[tuple[str, ...], str, int]]]] = {}
  for chain, text in TEMPLATES:
    if cfg.min_hops <= len(chain) <= cfg.max_hops:
      # A chain that comes back to its start ("the capital of the country where X is located"
      # when X is that capital) would have the question's own entity as its answer.
      starts = [s for s in world.by_kind(RELATIONS[chain[0]][0]) if _follow(ents, s, chain) != s]
      rng.shuffle(starts)
      pools.setdefault(len(chain), []).append([(chain, text, s) for s in starts])
  wanted = cfg.eval_size + cfg.sft_size + cfg.train_size
  available = sum(len(p) for ts in pools.values() for p in ts)
  if wanted > available:
    raise ValueError(f"the knowledge base has {available} distinct questions with "
                     f"{cfg.min_hops}-{cfg.max_hops} hops but the splits ask for {wanted}; lower "
                     "train_size / eval_size / sft_size or raise the entity counts")
  order: list[tuple[tuple[str, ...], str, int]] = []
  cursor = {h: 0 for h in pools}
  while len(order) < wanted:
    for h in sorted(pools):
      templates = [t for t in pools[h] if t]
      if not templates:
        continue
      pick = templates[cursor[h] % len(templates)]
      cursor[h] += 1
      order.append(pick.pop())
      if len(order) == wanted:
        break
  out: dict[str, list[Question]] = {}
  start = 0
  for split in ("eval", "sft", "train"):  # eval first: its questions never depend on train_size
    n = getattr(cfg, f"{split}_size")
    out[split] = [_question(f"{split}-{k}", order[start + k], ents, world.documents)
                  for k in range(n)]
    start += n
  return out


def _follow(ents: list[Entity], start: int, chain: tuple[str, ...]) -> int:
  """The entity a relation chain leads to from `start`."""
  for rel in chain:
    start = ents[start].relations[rel]
  return start


def _question(qid: str, item, ents: list[Entity], docs: list[Document]) -> Question:
  chain, text, start = item
  cur, queries, hop_answers, sup = start, [], [], []
  for rel in chain:
    queries.append(ents[cur].name)
    sup.append(cur)
    cur = ents[cur].relations[rel]
    hop_answers.append(ents[cur].name)
  return Question(id=qid, question=text.format(e=ents[start].name), answers=(ents[cur].name,),
                  relations=tuple(chain), queries=tuple(queries), hop_answers=tuple(hop_answers),
                  supporting_ids=tuple(docs[s].id for s in sup),
                  supporting_titles=tuple(docs[s].title for s in sup))


# ----------------------------------------------------------------------------- tfds
class SearchQAKBConfig(tfds.core.BuilderConfig):
  """A tfds builder config carrying a `KBConfig`."""

  def __init__(self, kb: KBConfig):
    super().__init__(name=kb.dataset_name, version=_VERSION,
                     description=f"synthetic knowledge base: {dataclasses.asdict(kb)}")
    self.kb = kb


class _LocalDatasetInfo(tfds.core.DatasetInfo):
  """The info of a dataset that exists only where it was generated.

  tfds looks for the published info of a dataset that is not prepared yet in its bucket; it made
  an empty directory in the system's temporary directory for every builder it did that for (two
  a fresh knowledge base), and left it there."""

  def initialize_from_bucket(self) -> None:
    pass


class SearchQAKB(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """The knowledge base as a tfds dataset: split "documents" holds one record per document
  (kind "document": id, title, text); "train" / "eval" / "sft" hold questions (kind "question":
  text is the question; answers, relations, queries, hop answers, supporting documents).

  Not registered with tfds (nothing loads it by name); build it with `build_kb`."""

  name = "jaxagent_search_qa_kb"
  VERSION = tfds.core.Version(_VERSION)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> pathlib.Path:
    # tfds would locate this file through `importlib_resources`, an optional package; the
    # path is only used to look for a checksums file, which a generated dataset has none of.
    return pathlib.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    text, texts = tfds.features.Text(), tfds.features.Sequence(tfds.features.Text())
    return _LocalDatasetInfo(
        builder=self, description=self.builder_config.description,
        features=tfds.features.FeaturesDict({
            "id": text, "kind": text, "title": text, "text": text, "answers": texts,
            "relations": texts, "queries": texts, "hop_answers": texts,
            "supporting_ids": texts, "supporting_titles": texts}))

  def _split_generators(self, dl_manager):
    del dl_manager
    kb = self.builder_config.kb
    world = generate_world(kb)
    questions = generate_questions(world, kb)
    # tfds cannot write a split without examples (an AssertionError "No examples were yielded"
    # ended the build of every config with a split of size 0); such a split is not written, and
    # `load_kb` reads it as empty.
    return {"documents": self._generate_examples(world.documents),
            **{s: self._generate_examples(questions[s]) for s in SPLITS if questions[s]}}

  def _generate_examples(self, records):
    empty: tuple[str, ...] = ()
    for rec in records:
      if isinstance(rec, Document):
        yield rec.id, {"id": rec.id, "kind": "document", "title": rec.title, "text": rec.text,
                       "answers": empty, "relations": empty, "queries": empty,
                       "hop_answers": empty, "supporting_ids": empty, "supporting_titles": empty}
      else:
        yield rec.id, {"id": rec.id, "kind": "question", "title": "", "text": rec.question,
                       "answers": rec.answers, "relations": rec.relations,
                       "queries": rec.queries, "hop_answers": rec.hop_answers,
                       "supporting_ids": rec.supporting_ids,
                       "supporting_titles": rec.supporting_titles}


def default_data_dir() -> pathlib.Path:
  """`$JAXAGENT_DATA_DIR`, else `~/.cache/jaxagent/tensorflow_datasets`."""
  env = os.environ.get("JAXAGENT_DATA_DIR")
  if env:
    return _local_dir(env, "$JAXAGENT_DATA_DIR")
  return pathlib.Path.home() / ".cache" / "jaxagent" / "tensorflow_datasets"


def _local_dir(path: str | os.PathLike, what: str) -> pathlib.Path:
  """`path` as a local directory, "~" expanded (the shell leaves a "~" after "data_dir=" on a
  command line, or a quoted one, as it is: the dataset went to a folder named "~")."""
  # pathlib reads "gs://bucket/kb" as the relative path "gs:/bucket/kb": the dataset would be
  # written under a folder named "gs:" in the working directory, not in the bucket.
  if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", os.fspath(path)):
    raise ValueError(f"{what} must be a local directory, got the URL {os.fspath(path)!r}; the "
                     "knowledge base is generated in seconds where it is used (and locked there "
                     "while it is prepared): give a local path")
  return pathlib.Path(path).expanduser()


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
  """An exclusive lock between processes preparing the same data dir."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def build_kb(cfg: KBConfig, data_dir: str | os.PathLike | None = None) -> SearchQAKB:
  """The prepared builder of `cfg` under `data_dir` (generated on first use, then reused)."""
  data_dir = _local_dir(data_dir, "data_dir") if data_dir else default_data_dir()
  make = lambda: SearchQAKB(config=SearchQAKBConfig(cfg), data_dir=str(data_dir),  # noqa: E731
                            file_format="array_record")
  # A prepared dataset is only read: no lock, so a data dir that cannot be written (or locked)
  # serves one prepared elsewhere. A builder reads the dataset's info (its splits) when it is
  # made, so the one returned is made after the dataset was seen prepared.
  if make().is_prepared():
    return make()
  with _file_lock(data_dir / f".{cfg.dataset_name}.lock"):
    # Made under the lock: one made while another process was preparing the dataset found it
    # prepared and no splits.
    builder = make()
    if not builder.is_prepared():
      builder.download_and_prepare()
  return builder


# ----------------------------------------------------------------------------- reading
def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


def _texts(value) -> tuple[str, ...]:
  return tuple(_text(v) for v in value)


def decode_document(record: dict) -> Document:
  """A "documents" record as a `Document`."""
  return Document(title=_text(record["title"]), text=_text(record["text"]), id=_text(record["id"]))


def decode_question(record: dict) -> Question:
  """A question record as a `Question`."""
  return Question(id=_text(record["id"]), question=_text(record["text"]),
                  answers=_texts(record["answers"]), relations=_texts(record["relations"]),
                  queries=_texts(record["queries"]), hop_answers=_texts(record["hop_answers"]),
                  supporting_ids=_texts(record["supporting_ids"]),
                  supporting_titles=_texts(record["supporting_titles"]))


@dataclasses.dataclass
class KnowledgeBase:
  """Documents and questions read back from the prepared dataset."""

  config: KBConfig
  documents: list[Document]
  questions: dict[str, list[Question]]
  data_dir: pathlib.Path


def load_kb(cfg: KBConfig, data_dir: str | os.PathLike | None = None) -> KnowledgeBase:
  """Prepares the dataset if needed and reads every split from its data source."""
  builder = build_kb(cfg, data_dir)
  sources = builder.as_data_source()

  def read(split: str, decode) -> list:
    if split in SPLITS and getattr(cfg, f"{split}_size") == 0:
      return []  # not written (tfds writes no empty split)
    if split not in sources:
      raise ValueError(f"the prepared knowledge base at {builder.data_dir} has no split "
                       f"{split!r} (has {sorted(sources)}); delete that directory to rebuild it")
    source = sources[split]
    try:
      # A batch of records a read (the source's __getitems__): one a read, as grain's
      # MapDataset reads a tfds source, took 1.06 s at the default sizes, batched 0.59 s.
      return [decode(record) for start in range(0, len(source), _READ_BATCH)
              for record in source.__getitems__(
                  list(range(start, min(start + _READ_BATCH, len(source)))))]
    except Exception as e:  # noqa: BLE001 - a damaged file fails deep inside the reader
      raise ValueError(f"cannot read split {split!r} of the prepared knowledge base at "
                       f"{builder.data_dir} ({type(e).__name__}: {e}); delete that directory "
                       "to rebuild it") from e

  docs = sorted(read("documents", decode_document), key=lambda d: _doc_order(d.id))
  questions = {s: sorted(read(s, decode_question), key=lambda q: int(q.id.rsplit("-", 1)[1]))
               for s in SPLITS}
  return KnowledgeBase(cfg, docs, questions, pathlib.Path(builder.data_dir))


_READ_BATCH = 1024  # records of a split read at a time


def _doc_order(doc_id: str) -> int:
  return int(doc_id.rsplit("-", 1)[1])


def hop_thought(relation: str, subject: str) -> str:
  """What the searcher needs next, in words ("where X was born")."""
  return RELATIONS[relation][2].format(x=subject)


def hop_fact(relation: str, subject: str, obj: str) -> str:
  """The fact a hop establishes, in words ("X was born in Y")."""
  return RELATIONS[relation][3].format(x=subject, y=obj)


def question_chains(hops: Sequence[int] | None = None) -> list[tuple[str, ...]]:
  """Relation chains of the question templates (optionally only those with `hops` hops)."""
  return [c for c, _ in TEMPLATES if hops is None or len(c) in hops]
