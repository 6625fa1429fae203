"""Caption files: Karpathy's `dataset_coco.json`, COCO image-info lists, and the vocabulary built from train."""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from ..errors import DataError, folder_instead

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
SPLITS = ("train", "val", "test")
INT64_MAX = 2**63 - 1  # image ids become torch.long tensors


@dataclass
class ImageCaptions:
    image_id: int
    split: str  # train | val | test ("restval" is read as train)
    filepath: str  # train2014 | val2014 (COCO folder the image comes from)
    captions: list[list[str]] = field(default_factory=list)  # tokenized, lowercase
    raw: list[str] = field(default_factory=list)


def _load_json(path: str | Path, what: str):
    path = Path(path)
    if not path.is_file():
        raise DataError(folder_instead(path, what) or f"{path}: {what} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    except ValueError:  # Python's int() refuses more than 4300 digits, deep inside json
        raise DataError(f"{path}: holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:  # json recurses per nesting level: a hostile file nests beyond the interpreter's limit
        raise DataError(f"{path}: not a {what} (JSON nested too deep to read)") from None


def is_image_id(value) -> bool:
    """A COCO image id: a non-negative int within int64 (bools are not ids)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX


# letters and digits of any script (`[^\W_]`) and apostrophes: on ASCII the same as [a-z0-9']+ after lower(), and
# "café" stays one word, as pycocoevalcap's PTB tokenizer keeps it for scoring (ASCII-only cut it to "caf")
_TOKEN = re.compile(r"(?:[^\W_]|')+")


def tokenize(sentence: str) -> list[str]:
    """Lowercase words without punctuation: the form Karpathy's `tokens` already have."""
    return _TOKEN.findall(sentence.lower())


def read_karpathy(path: str | Path) -> dict[str, list[ImageCaptions]]:
    """`{"train": [...], "val": [...], "test": [...]}` from Karpathy's dataset_coco.json (restval counts as train)."""
    doc = _load_json(path, "Karpathy captions file")
    images = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(images, list):
        raise DataError(f"{path}: expected an object with an 'images' list")
    out: dict[str, list[ImageCaptions]] = {s: [] for s in SPLITS}
    seen: set[int] = set()
    for i, img in enumerate(images):
        if not isinstance(img, dict):
            raise DataError(f"{path}: images[{i}] is not an object")
        image_id = img.get("cocoid", img.get("imgid"))
        if not is_image_id(image_id):
            raise DataError(f"{path}: images[{i}] has no 'cocoid' that is a non-negative 64-bit integer "
                            f"(got {image_id!r:.40})")
        if image_id in seen:
            raise DataError(f"{path}: image id {image_id} appears twice")
        seen.add(image_id)
        split = img.get("split")
        split = "train" if split == "restval" else split
        if split not in SPLITS:
            raise DataError(f"{path}: image id {image_id} has unknown split {img.get('split')!r}")
        sentences = img.get("sentences")
        caps, raws = _sentences([] if sentences is None else sentences, f"{path}: image id {image_id}")
        if split != "test" and not caps:
            raise DataError(f"{path}: image id {image_id} ({split}) has no sentences")
        out[split].append(ImageCaptions(image_id, split, img.get("filepath", ""), caps, raws))
    return out


def require_splits(splits: dict[str, list[ImageCaptions]], path: str | Path, names=("train", "val")) -> None:
    """Training learns from train and picks epochs by val: refuse it up front when either split has no images."""
    for name in names:
        if not splits.get(name):
            raise DataError(f"{path}: the {name} split has no images (training needs images in train and val)")


def _sentences(sentences, where: str) -> tuple[list[list[str]], list[str]]:
    """Tokenized captions and raw sentences of one image; `where` (file and image id) leads every error."""
    if not isinstance(sentences, list):
        raise DataError(f"{where}: 'sentences' is a {type(sentences).__name__}, not a list")
    caps, raws = [], []
    for j, sent in enumerate(sentences):
        if not isinstance(sent, dict):
            raise DataError(f"{where}: sentences[{j}] is a {type(sent).__name__}, not an object")
        tokens, raw = sent.get("tokens"), sent.get("raw")
        if raw is not None and not isinstance(raw, str):
            raise DataError(f"{where}: sentences[{j}].raw is a {type(raw).__name__}, not a string")
        if tokens is None:
            if raw is None:
                raise DataError(f"{where}: sentences[{j}] has neither 'tokens' nor 'raw'")
            tokens = tokenize(raw)
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise DataError(f"{where}: sentences[{j}].tokens must be a list of strings, got {tokens!r:.60}")
        tokens = [t.lower() for t in tokens]
        if not tokens:  # would train <bos> <eos> as a caption and be an empty reference for CIDEr-D
            raise DataError(f"{where}: sentences[{j}] is an empty caption (no words in its tokens or raw)")
        caps.append(tokens)
        raws.append(raw if raw is not None else " ".join(tokens))
    return caps, raws


def read_image_info(path: str | Path) -> list[int]:
    """Image ids of a COCO image-info file (`image_info_test2014.json`: `{"images": [{"id": ...}]}`)."""
    doc = _load_json(path, "COCO image-info file")
    images = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(images, list):
        raise DataError(f"{path}: expected an object with an 'images' list")
    ids = []
    for i, img in enumerate(images):
        image_id = img.get("id") if isinstance(img, dict) else None
        if not is_image_id(image_id):
            raise DataError(f"{path}: images[{i}] has no 'id' that is a non-negative 64-bit integer "
                            f"(got {image_id!r:.40})")
        ids.append(image_id)
    if len(set(ids)) != len(ids):
        dup = next(x for x, c in Counter(ids).items() if c > 1)
        raise DataError(f"{path}: image id {dup} appears twice")
    return ids


class Vocab:
    """Word <-> index. Index 0..3 are <pad>, <bos>, <eos>, <unk>; the rest sorted by count then word."""

    def __init__(self, words: list[str]):
        if tuple(words[: len(SPECIALS)]) != SPECIALS:
            raise DataError(f"a vocabulary must start with {SPECIALS}")
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.pad, self.bos, self.eos, self.unk = (self.index[s] for s in SPECIALS)

    @classmethod
    def build(cls, captions: list[list[str]], min_count: int = 5) -> "Vocab":
        counts = Counter(w for cap in captions for w in cap)
        kept = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIALS),
                      key=lambda w: (-counts[w], w))
        return cls(list(SPECIALS) + kept)

    def __len__(self) -> int:
        return len(self.words)

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.words == other.words

    def encode(self, tokens: list[str], max_len: int) -> list[int]:
        """<bos> w1 .. wn <eos>, words cut to max_len."""
        ids = [self.index.get(t, self.unk) for t in tokens[:max_len]]
        return [self.bos] + ids + [self.eos]

    def decode(self, ids) -> str:
        words = []
        for i in ids:
            i = int(i)
            if i == self.eos:
                break
            if i in (self.pad, self.bos):
                continue
            words.append(self.words[i])
        return " ".join(words)
