"""Caption metrics: a vectorised CIDEr-D and the COCO caption evaluation.

``CiderD`` reproduces ``pycocoevalcap.cider.Cider`` (CIDEr-D: 1..4-grams, tf-idf vectors, clipped
cosine similarity, Gaussian length penalty with sigma = 6, x10) number for number, but computes
all candidate/reference pairs of a call with a few numpy operations instead of Python loops over
n-grams, which makes it cheap enough to be the SCST reward.

Document frequencies (df) come either from the references of the call (``CiderD()``, exactly what
pycocoevalcap does) or from a training corpus computed once (``CiderD.from_corpus``; the usual
choice for SCST rewards), which can be saved as JSON or kept inside a checkpoint dict.

``coco_scores`` runs the standard COCO caption evaluation (PTB tokenizer, BLEU-1..4, METEOR,
ROUGE-L, CIDEr and, when its Stanford CoreNLP models are installed, SPICE) on raw captions and
returns every score on the COCO papers' x100 scale (``SCALE``: CIDEr 112.3, BLEU-4 36.9), as does
``caption_scores``; ``CiderD`` itself keeps pycocoevalcap's scale (1.123), the SCST reward's;
``evaluate_results_file`` does the same for a COCO results JSON against Karpathy's
``dataset_coco.json``; ``best_constant_caption`` gives the "one caption for every image" baseline.

Two details of pycocoevalcap are kept on purpose, so that the numbers stay comparable with
published ones:

* the "length" used by the length penalty is the number of *bigrams* of a sentence
  (``max(words - 1, 0)``), not its number of words;
* an n-gram that never occurs in the df corpus gets df = 1 (idf = log(num_docs)).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.meteor import meteor as pycoco
from pycocoevalcap.rouge.rouge import Rouge
import pycocoevalcap.spice as spice_pkg
from pycocoevalcap.spice.spice import Spice
from pycocoevalcap.tokenizer import ptbtokenizer as ptb
from .errors import A2Error, DataError, folder_instead

__all__ = [
    "CiderD",
    "coco_scores",
    "caption_scores",
    "evaluate_results_file",
    "best_constant_caption",
    "load_results",
    "load_split_references",
    "ptb_tokenize",
    "simple_tokenize",
    "spice_available",
    "METRIC_NAMES",
    "SCALE",
    "SCALE_NAME",
]

#: Metric keys returned by :func:`coco_scores` (SPICE only when it ran).
METRIC_NAMES = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "SPICE")
#: coco_scores / caption_scores report pycocoevalcap's numbers times SCALE, the papers' convention.
SCALE = 100.0
SCALE_NAME = "x100"

_STATE_FORMAT = "a2tune.cider-d.df"
_STATE_VERSION = 1


# --------------------------------------------------------------------------------------------
# n-gram encoding
# --------------------------------------------------------------------------------------------
# An n-gram of order k >= 2 is identified by (id of its first k-1 words, id of its last word),
# packed into one int64 key; both parts stay below 2**31.
_BIG = 1 << 31


def _unique(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values (numpy's hash-based np.unique is slow on these structured keys)."""
    s = np.sort(a)
    if s.size:
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
    return s


class _Table:
    """The n-grams of a df corpus as arrays: a trie stored level by level.

    ``words``: word -> word id; ``uni[word id]`` = n-gram id of that unigram; for order k >= 2,
    ``keys[k - 2]`` (sorted) = parent n-gram id * _BIG + last word id and ``gids[k - 2]`` the
    n-gram ids. N-gram ids are 0 .. size - 1 and index ``df``.
    """

    def __init__(self, n: int):
        self.n = n
        self.words: dict[str, int] = {}
        self.uni = np.zeros(0, dtype=np.int64)
        self.keys = [np.zeros(0, dtype=np.int64) for _ in range(n - 1)]
        self.gids = [np.zeros(0, dtype=np.int64) for _ in range(n - 1)]
        self.size = 0

    def extend(self, enc: "_Encoded") -> None:
        """Adopt the n-grams an encoding found outside the table (their ids are already final)."""
        if enc.new_words:
            self.words.update(enc.new_words)  # ids were given in insertion order
        for k, (keys, gids) in enumerate(enc.new_levels, start=1):
            if not keys.size:
                continue
            if k == 1:
                # New unigrams are exactly the new words, numbered in word id order.
                self.uni = np.concatenate([self.uni, gids])
            else:
                allk = np.concatenate([self.keys[k - 2], keys])
                allg = np.concatenate([self.gids[k - 2], gids])
                order = np.argsort(allk, kind="stable")
                self.keys[k - 2], self.gids[k - 2] = allk[order], allg[order]
        self.size = enc.num_ids

    def to_arrays(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(words, prefix, last): n-gram i = n-gram prefix[i] (-1: none) + word last[i]."""
        prefix = np.full(self.size, -1, dtype=np.int64)
        last = np.zeros(self.size, dtype=np.int64)
        last[self.uni] = np.arange(self.uni.size, dtype=np.int64)
        for keys, gids in zip(self.keys, self.gids):
            prefix[gids] = keys // _BIG
            last[gids] = keys % _BIG
        return list(self.words), prefix, last

    @classmethod
    def from_arrays(cls, words: Sequence[str], prefix: Sequence[int], last: Sequence[int], n: int,
                    where: str) -> "_Table":
        table = cls(n)
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w and len(w.split()) == 1
                                                            for w in words):
            raise ValueError(f"{where}: 'words' must be a list of words (no whitespace)")
        table.words = {w: i for i, w in enumerate(words)}
        if len(table.words) != len(words):
            raise ValueError(f"{where}: 'words' has duplicates")
        try:
            prefix_a = np.asarray(prefix, dtype=np.int64).reshape(-1)
            last_a = np.asarray(last, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: 'prefix' and 'last_word' must be lists of ints") from None
        size = prefix_a.size
        idx = np.arange(size, dtype=np.int64)
        if last_a.size != size:
            raise ValueError(f"{where}: 'prefix' and 'last_word' differ in length")
        if size and (prefix_a.min() < -1 or np.any(prefix_a >= idx) or last_a.min() < 0
                     or last_a.max() >= len(words)):
            raise ValueError(f"{where}: 'prefix' must point to earlier n-grams and 'last_word' into 'words'")
        is_uni = prefix_a < 0
        uni_words = last_a[is_uni]
        if uni_words.size != len(words) or np.unique(uni_words).size != len(words):
            raise ValueError(f"{where}: every word needs exactly one unigram entry")
        table.uni = np.zeros(len(words), dtype=np.int64)
        table.uni[uni_words] = idx[is_uni]
        order = np.where(is_uni, 1, 0)
        for _ in range(n - 1):
            todo = (order == 0) & (order[np.maximum(prefix_a, 0)] > 0)
            if not todo.any():
                break
            order[todo] = order[prefix_a[todo]] + 1
        if np.any(order == 0):
            raise ValueError(f"{where}: n-grams longer than n={n} words")
        for k in range(2, n + 1):
            sel = order == k
            keys = prefix_a[sel] * _BIG + last_a[sel]
            by_key = np.argsort(keys, kind="stable")
            keys = keys[by_key]
            if keys.size > 1 and np.any(keys[1:] == keys[:-1]):
                raise ValueError(f"{where}: an n-gram of {k} words appears twice")
            table.keys[k - 2], table.gids[k - 2] = keys, idx[sel][by_key]
        table.size = size
        return table

    def lookup(self, ngram: str) -> int:
        """Id of an n-gram given as space-separated words, or -1."""
        words = ngram.split()
        if not words or len(words) > self.n or words[0] not in self.words:
            return -1
        gid = int(self.uni[self.words[words[0]]])
        for k, w in enumerate(words[1:], start=2):
            wid = self.words.get(w)
            keys = self.keys[k - 2]
            if wid is None or not keys.size:
                return -1
            key = gid * _BIG + wid
            at = min(int(np.searchsorted(keys, key)), keys.size - 1)
            if keys[at] != key:
                return -1
            gid = int(self.gids[k - 2][at])
        return gid


class _Encoded:
    """N-gram occurrences of a list of sentences, counted: one row per (sentence, n-gram).

    Rows are sorted by (sentence, order, id). Ids below ``table.size`` are the table's; others
    are local to this encoding (consistent across all its sentences).
    """

    __slots__ = ("num", "sent", "order", "ids", "tf", "length", "num_ids", "new_words", "new_levels")

    def __init__(self, sentences: Sequence[str], n: int, table: _Table | None):
        flat: list[str] = []
        extend = flat.extend
        lengths: list[int] = []
        append = lengths.append
        for s in sentences:
            w = s.split()
            append(len(w))
            extend(w)
        num = len(lengths)
        words_per_sent = np.array(lengths, dtype=np.int64).reshape(num)

        # word ids: the table's words first, unseen words after them
        base_w = len(table.words) if table is not None else 0
        base_id = table.size if table is not None else 0
        new_words: dict[str, int] = {}
        setdefault = new_words.setdefault
        if table is not None and table.words:
            get = table.words.get
            wid = np.array([get(w, -1) for w in flat], dtype=np.int64)
            unseen = np.flatnonzero(wid < 0)
            if unseen.size:
                wid[unseen] = [setdefault(flat[i], base_w + len(new_words)) for i in unseen.tolist()]
        else:
            wid = np.array([setdefault(w, base_w + len(new_words)) for w in flat], dtype=np.int64)
        if base_w + len(new_words) >= _BIG:
            raise ValueError("CiderD: more than 2**31 distinct words")

        ntok = wid.size
        sent_of_tok = np.repeat(np.arange(num, dtype=np.int64), words_per_sent)
        start = np.cumsum(words_per_sent) - words_per_sent
        remaining = words_per_sent[sent_of_tok] - (np.arange(ntok, dtype=np.int64) - start[sent_of_tok])

        next_id = base_id
        new_levels: list[tuple[np.ndarray, np.ndarray]] = []
        occ_sent, occ_order, occ_ids = [], [], []
        pos = np.arange(ntok, dtype=np.int64)  # start positions of the n-grams of the current order
        gid = np.zeros(0, dtype=np.int64)
        for k in range(1, n + 1):
            if k > 1:
                keep = remaining[pos] >= k
                pos, gid = pos[keep], gid[keep]
                if not pos.size:
                    new_levels.extend((np.zeros(0, dtype=np.int64),) * 2 for _ in range(n - k + 1))
                    break
                key = gid * _BIG + wid[pos + (k - 1)]
            else:
                key = wid
            # Look each distinct n-gram up once, with sorted needles.
            uniq, inv = np.unique(key, return_inverse=True)
            ugid = np.full(uniq.size, -1, dtype=np.int64)
            if table is not None and uniq.size:
                if k == 1:
                    known = uniq < base_w
                    ugid[known] = table.uni[uniq[known]]
                elif table.keys[k - 2].size:
                    tk = table.keys[k - 2]
                    at = np.minimum(np.searchsorted(tk, uniq), tk.size - 1)
                    hit = tk[at] == uniq
                    ugid[hit] = table.gids[k - 2][at[hit]]
            miss = np.flatnonzero(ugid < 0)
            ugid[miss] = np.arange(next_id, next_id + miss.size, dtype=np.int64)
            new_levels.append((uniq[miss], ugid[miss]))
            next_id += miss.size
            gid = ugid[inv.reshape(-1)]
            occ_sent.append(sent_of_tok[pos])
            occ_order.append(np.full(pos.size, k - 1, dtype=np.int64))
            occ_ids.append(gid)

        m = max(next_id, 1)
        keys, tf = np.unique((np.concatenate(occ_sent) * n + np.concatenate(occ_order)) * m
                             + np.concatenate(occ_ids), return_counts=True)
        so = keys // m
        self.num = num
        self.ids = keys - so * m
        self.sent = so // n
        self.order = so - self.sent * n
        self.tf = tf.astype(np.float64)
        # pycocoevalcap counts the *bigrams* of a sentence as its length (``if n == 1``).
        self.length = np.maximum(words_per_sent - 1, 0).astype(np.float64)
        self.num_ids = next_id
        self.new_words = new_words
        self.new_levels = new_levels


class _Vectors:
    """tf-idf vectors of some sentences of an encoding (rows sorted by (sentence, order, id))."""

    __slots__ = ("num", "sent", "order", "ids", "val", "norm", "length")

    def __init__(self, enc: _Encoded, lo: int, hi: int, idf: np.ndarray, n: int):
        a, b = np.searchsorted(enc.sent, [lo, hi])
        self.num = hi - lo
        self.sent = enc.sent[a:b] - lo
        self.order = enc.order[a:b]
        self.ids = enc.ids[a:b]
        self.val = enc.tf[a:b] * idf[a:b]
        sq = np.bincount(self.sent * n + self.order, weights=self.val * self.val, minlength=self.num * n)
        self.norm = np.sqrt(sq).reshape(self.num, n)
        self.length = enc.length[lo:hi]


def _pair_scores(cb: _Vectors, rb: _Vectors, cand_group: np.ndarray, group_first: np.ndarray,
                 group_count: np.ndarray, n: int, sigma: float, m: int) -> np.ndarray:
    """CIDEr-D of candidate c against the reference rows of its group (image) ``cand_group[c]``.

    Pairs (c, r) are numbered candidate by candidate, r in the order of the group's references.
    """
    num_c = cb.num
    nref = group_count[cand_group]
    pstart = np.cumsum(nref) - nref
    num_pairs = int(nref.sum())
    pair_cand = np.repeat(np.arange(num_c, dtype=np.int64), nref)
    pair_ref = np.repeat(group_first[cand_group], nref) + (np.arange(num_pairs, dtype=np.int64)
                                                          - np.repeat(pstart, nref))
    acc = np.zeros(num_pairs * n)
    if cb.ids.size and rb.ids.size:
        # Reference rows sorted by (group, order, id): each candidate n-gram finds, in one range,
        # the references of its image that contain it.
        group_of_row = np.repeat(np.arange(group_count.size, dtype=np.int64), group_count)
        gkeys = (group_of_row[rb.sent] * n + rb.order) * m + rb.ids
        by_key = np.argsort(gkeys, kind="stable")
        gkeys = gkeys[by_key]
        c = cb.sent
        q = (cand_group[c] * n + cb.order) * m + cb.ids
        lo = np.searchsorted(gkeys, q, side="left")
        cnt = np.searchsorted(gkeys, q, side="right") - lo
        e = np.repeat(np.arange(q.size, dtype=np.int64), cnt)
        row = by_key[np.repeat(lo, cnt) + (np.arange(e.size, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt))]
        rv = rb.val[row]
        cv = cb.val[e]
        ce = c[e]
        pair = pstart[ce] + (rb.sent[row] - group_first[cand_group[ce]])
        # vrama91's clipping: min(hyp, ref) * ref
        acc = np.bincount(pair * n + cb.order[e], weights=np.minimum(cv, rv) * rv, minlength=num_pairs * n)
    acc = acc.astype(np.float64, copy=False).reshape(num_pairs, n)
    denom = cb.norm[pair_cand] * rb.norm[pair_ref]
    val = np.divide(acc, denom, out=acc.copy(), where=denom != 0)
    delta = cb.length[pair_cand] - rb.length[pair_ref]
    val *= np.exp(-(delta * delta) / (2.0 * sigma * sigma))[:, None]
    total = np.bincount(pair_cand, weights=val.sum(axis=1), minlength=num_c)
    return total / n / nref * 10.0


def _constant_scores(
    cb: _Vectors, rb: _Vectors, group_of_ref: np.ndarray, group_count: np.ndarray, n: int, sigma: float
) -> np.ndarray:
    """CIDEr-D of the single sentence in ``cb`` against every reference group of ``rb``."""
    by_id = np.argsort(cb.ids)
    cids = cb.ids[by_id]
    cvals = cb.val[by_id]
    acc = np.zeros(rb.num * n)
    if cids.size and rb.ids.size:
        at = np.minimum(np.searchsorted(cids, rb.ids), cids.size - 1)
        hit = cids[at] == rb.ids
        rv = rb.val[hit]
        cv = cvals[at[hit]]
        acc = np.bincount(rb.sent[hit] * n + rb.order[hit], weights=np.minimum(cv, rv) * rv, minlength=rb.num * n)
    acc = acc.astype(np.float64, copy=False).reshape(rb.num, n)
    denom = cb.norm[0][None, :] * rb.norm
    val = np.divide(acc, denom, out=acc.copy(), where=denom != 0)
    delta = cb.length[0] - rb.length
    val *= np.exp(-(delta * delta) / (2.0 * sigma * sigma))[:, None]
    total = np.bincount(group_of_ref, weights=val.sum(axis=1), minlength=group_count.size)
    return total / n / group_count * 10.0


# --------------------------------------------------------------------------------------------
# CIDEr-D
# --------------------------------------------------------------------------------------------
class CiderD:
    """CIDEr-D, a vectorised drop-in for ``pycocoevalcap.cider.cider.Cider``.

    ``CiderD()`` takes document frequencies from the references of each call, exactly like
    pycocoevalcap. ``CiderD.from_corpus(refs)`` (or ``from_state_dict``) fixes them,
    with ``ref_len = log(number of images of the corpus)``, for SCST rewards.

    Inputs are tokenized, space-separated strings (as after ``PTBTokenizer``).
    """

    def __init__(self, n: int = 4, sigma: float = 6.0, df: str = "corpus"):
        if df != "corpus":
            raise ValueError(
                f"CiderD(df={df!r}): only df='corpus' (df from the references of each call) is built "
                "here; use CiderD.from_corpus(...) or CiderD.from_state_dict(...) "
                "for precomputed document frequencies"
            )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"CiderD: n must be a positive int, got {n!r}")
        if not float(sigma) > 0:
            raise ValueError(f"CiderD: sigma must be > 0, got {sigma!r}")
        self.n = n
        self.sigma = float(sigma)
        self._table: _Table | None = None  # n-grams of the df corpus
        self._df: np.ndarray | None = None  # df per n-gram id of the table
        self._idf: np.ndarray | None = None  # ref_len - log(max(1, df))
        self._num_docs: int | None = None
        self._ref_len: float | None = None

    # ---- introspection ------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``"corpus"`` (df from each call's references) or ``"precomputed"``."""
        return "corpus" if self._table is None else "precomputed"

    @property
    def num_docs(self) -> int | None:
        """Number of images of the df corpus (precomputed mode)."""
        return self._num_docs

    @property
    def ref_len(self) -> float | None:
        """log(num_docs) of the df corpus (precomputed mode)."""
        return self._ref_len

    def method(self) -> str:
        return "CIDEr"

    def __repr__(self) -> str:
        if self._table is None:
            return f"CiderD(n={self.n}, sigma={self.sigma}, df='corpus')"
        return (f"CiderD(n={self.n}, sigma={self.sigma}, df precomputed over {self._num_docs} images, "
                f"{self._table.size} n-grams)")

    def _set_df(self, table: _Table, df: np.ndarray, num_docs: int, ref_len: float) -> None:
        self._table = table
        self._df = np.asarray(df, dtype=np.float64)
        self._num_docs = int(num_docs)
        self._ref_len = float(ref_len)
        self._idf = self._ref_len - np.log(np.maximum(1.0, self._df))

    # ---- precomputed document frequencies -----------------------------------------------
    @classmethod
    def from_corpus(cls, references: Sequence[Sequence[str]], n: int = 4, sigma: float = 6.0,
                    chunk_images: int = 5000) -> "CiderD":
        """Document frequencies from a corpus: ``references[i]`` = tokenized captions of image i."""
        refs = list(references)
        if not refs:
            raise ValueError("CiderD.from_corpus: the corpus is empty")
        for i, group in enumerate(refs):
            _check_ref_list(group, f"CiderD.from_corpus: references[{i}]")
        obj = cls(n=n, sigma=sigma)
        table = _Table(n)
        df = np.zeros(0, dtype=np.int64)
        step = max(1, int(chunk_images))
        for start in range(0, len(refs), step):
            sents, counts = _flatten_groups(refs[start:start + step])
            enc = _Encoded(sents, n, table)
            table.extend(enc)
            m = max(table.size, 1)
            group_of_sent = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
            docs = _unique(group_of_sent[enc.sent] * m + enc.ids)
            df = np.concatenate([df, np.zeros(table.size - df.size, dtype=np.int64)])
            df += np.bincount(docs % m, minlength=table.size)
        obj._set_df(table, df, len(refs), float(np.log(float(len(refs)))))
        return obj

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable state (the df of a corpus); only for precomputed df.

        N-gram i is n-gram ``prefix[i]`` (-1 for none) followed by ``words[last_word[i]]``;
        ``df[i]`` is the number of corpus images whose references contain it.
        """
        if self._table is None:
            raise ValueError("CiderD.state_dict: this scorer takes df from each call's references "
                             "(df='corpus'); build one with CiderD.from_corpus(...) to keep df")
        words, prefix, last = self._table.to_arrays()
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "n": self.n,
            "sigma": self.sigma,
            "num_docs": self._num_docs,
            "ref_len": self._ref_len,
            "words": words,
            "prefix": prefix.tolist(),
            "last_word": last.tolist(),
            "df": [int(x) for x in self._df.tolist()],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "CiderD":
        where = "CiderD.from_state_dict"
        if not isinstance(state, Mapping):
            raise ValueError(f"{where}: expected a dict, got {type(state).__name__}")
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"{where}: 'format' must be {_STATE_FORMAT!r}, got {state.get('format')!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"{where}: unsupported version {state.get('version')!r} (expected {_STATE_VERSION})")
        for key in ("n", "sigma", "num_docs", "ref_len", "words", "prefix", "last_word", "df"):
            if key not in state:
                raise ValueError(f"{where}: missing key {key!r}")
        n, num_docs = state["n"], state["num_docs"]
        if not _is_int(n) or n < 1:
            raise ValueError(f"{where}: 'n' must be a positive int, got {n!r}")
        if not _is_int(num_docs) or num_docs < 1:
            raise ValueError(f"{where}: 'num_docs' must be a positive int, got {num_docs!r}")
        try:
            df = np.asarray(state["df"], dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: 'df' must be a list of numbers") from None
        if df.size != len(state["prefix"]):
            raise ValueError(f"{where}: 'df' and 'prefix' must have the same length")
        if df.size and (df.min() < 0 or df.max() > num_docs):
            raise ValueError(f"{where}: df values must lie in [0, num_docs={num_docs}]")
        table = _Table.from_arrays(state["words"], state["prefix"], state["last_word"], n, where)
        obj = cls(n=n, sigma=float(state["sigma"]))
        obj._set_df(table, df, num_docs, float(state["ref_len"]))
        return obj

    def document_frequency(self, ngram: str) -> float:
        """df of an n-gram (space-separated words) in the precomputed corpus (0 if absent)."""
        if self._table is None:
            raise ValueError("CiderD.document_frequency: df='corpus' mode has no fixed df")
        gid = self._table.lookup(ngram)
        return float(self._df[gid]) if gid >= 0 else 0.0

    # ---- scoring ------------------------------------------------------------------------
    def compute_score(self, gts: Mapping[Any, Sequence[str]], res: Mapping[Any, Sequence[str]]
                      ) -> tuple[float, np.ndarray]:
        """pycocoevalcap's interface: ``(mean, per-image scores in gts key order)``."""
        missing = [k for k in gts if k not in res]
        extra = [k for k in res if k not in gts]
        if missing or extra:
            raise ValueError(
                "CiderD.compute_score: gts and res must have the same image ids"
                + (f"; missing from res: {_fmt_ids(missing)}" if missing else "")
                + (f"; not in gts: {_fmt_ids(extra)}" if extra else "")
            )
        keys = list(gts.keys())
        if not keys:
            raise ValueError("CiderD.compute_score: no images")
        cands = []
        for k in keys:
            hypo = res[k]
            if isinstance(hypo, str):
                cands.append(hypo)
            elif isinstance(hypo, (list, tuple)) and len(hypo) == 1 and isinstance(hypo[0], str):
                cands.append(hypo[0])
            else:
                raise ValueError(f"CiderD.compute_score: res[{k!r}] must be a list with one caption, got {hypo!r}")
        scores = self._score(cands, [gts[k] for k in keys], "gts")
        return float(np.mean(scores)), scores

    def scores(self, candidates: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
        """One CIDEr-D per candidate; ``references[i]`` are the tokenized references of candidate i.

        Candidates that share a reference list (the same object or the same captions) share its
        vectors. With precomputed df this is the SCST reward; in ``df='corpus'`` mode every
        candidate counts as one image, as in ``compute_score``.
        """
        if len(candidates) != len(references):
            raise ValueError(f"CiderD.scores: {len(candidates)} candidates but {len(references)} reference lists")
        for i, c in enumerate(candidates):
            if not isinstance(c, str):
                raise ValueError(f"CiderD.scores: candidates[{i}] must be a str, got {type(c).__name__}")
        return self._score(list(candidates), references, "references")

    def _idf_of(self, enc: _Encoded, df_local: np.ndarray | None, ref_len: float) -> np.ndarray:
        """idf per row of ``enc``: ref_len - log(max(1, df)); n-grams outside the df corpus get ref_len."""
        if self._table is None:
            return ref_len - np.log(np.maximum(1.0, df_local[enc.ids]))
        size = self._table.size
        idf = np.full(enc.ids.size, ref_len)
        known = enc.ids < size
        idf[known] = self._idf[enc.ids[known]]
        return idf

    def _score(self, cands: list[str], groups: Sequence[Sequence[str]], what: str) -> np.ndarray:
        n = self.n
        if not cands:
            return np.zeros(0)
        # Candidates with the same references share one set of reference vectors.
        by_obj: dict[int, int] = {}
        by_text: dict[tuple, int] = {}
        uniq: list[Sequence[str]] = []
        # every list looked up by id() is held until the end: a sequence that hands out a fresh list per item frees
        # it at the next one, whose new list could take its id() and be scored against the freed one's references
        held: list[Sequence[str]] = []
        cand_group = np.empty(len(cands), dtype=np.int64)
        for i, g in enumerate(groups):
            gi = by_obj.get(id(g))
            if gi is None:
                held.append(g)
                _check_ref_list(g, f"CiderD: {what}[{i}]")
                key = tuple(g)
                gi = by_text.get(key)
                if gi is None:
                    gi = by_text[key] = len(uniq)
                    uniq.append(g)
                by_obj[id(g)] = gi
            cand_group[i] = gi
        sents, group_count = _flatten_groups(uniq)
        num_refs = len(sents)
        enc = _Encoded(sents + cands, n, self._table)
        m = max(enc.num_ids, 1)
        df_local = None
        if self._table is None:
            # df = number of images whose references hold the n-gram; every candidate is an image.
            docs = np.bincount(cand_group, minlength=len(uniq)).astype(np.float64)
            group_of_sent = np.repeat(np.arange(len(uniq), dtype=np.int64), group_count)
            is_ref = enc.sent < num_refs
            pairs = _unique(group_of_sent[enc.sent[is_ref]] * m + enc.ids[is_ref])
            df_local = np.bincount(pairs % m, weights=docs[pairs // m], minlength=m)
            ref_len = float(np.log(float(len(cands))))
        else:
            ref_len = self._ref_len
        idf = self._idf_of(enc, df_local, ref_len)
        rb = _Vectors(enc, 0, num_refs, idf, n)
        cb = _Vectors(enc, num_refs, num_refs + len(cands), idf, n)
        group_first = np.cumsum(group_count) - group_count
        return _pair_scores(cb, rb, cand_group, group_first, group_count, n, self.sigma, m)

    def constant_scores(self, candidate: str, references: Sequence[Sequence[str]]) -> np.ndarray:
        """CIDEr-D of one caption used for every image: one score per reference list.

        In ``df='corpus'`` mode df comes from ``references`` (one image per list): the same
        numbers as ``compute_score({i: refs_i}, {i: [candidate]})``.
        """
        return self._constant_many([candidate], references)[0]

    def _constant_many(self, candidates: Sequence[str], references: Sequence[Sequence[str]]) -> list[np.ndarray]:
        n = self.n
        groups = list(references)
        if not groups:
            raise ValueError("CiderD.constant_scores: no reference lists")
        for i, g in enumerate(groups):
            _check_ref_list(g, f"CiderD: references[{i}]")
        sents, group_count = _flatten_groups(groups)
        num_refs = len(sents)
        enc = _Encoded(sents + list(candidates), n, self._table)
        m = max(enc.num_ids, 1)
        group_of_sent = np.repeat(np.arange(len(groups), dtype=np.int64), group_count)
        df_local = None
        if self._table is None:
            is_ref = enc.sent < num_refs
            pairs = _unique(group_of_sent[enc.sent[is_ref]] * m + enc.ids[is_ref])
            df_local = np.bincount(pairs % m, minlength=m).astype(np.float64)
            ref_len = float(np.log(float(len(groups))))
        else:
            ref_len = self._ref_len
        idf = self._idf_of(enc, df_local, ref_len)
        rb = _Vectors(enc, 0, num_refs, idf, n)
        out = []
        for i in range(len(candidates)):
            cb = _Vectors(enc, num_refs + i, num_refs + i + 1, idf, n)
            out.append(_constant_scores(cb, rb, group_of_sent, group_count, n, self.sigma))
        return out


def _flatten_groups(groups: Sequence[Sequence[str]]) -> tuple[list[str], np.ndarray]:
    sents: list[str] = []
    for g in groups:
        sents.extend(g)
    return sents, np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))


def _check_ref_list(group: Any, where: str) -> None:
    if isinstance(group, str) or not isinstance(group, Sequence) or len(group) == 0:
        raise ValueError(f"{where} must be a non-empty list of captions, got {group!r}")
    for s in group:
        if not isinstance(s, str):
            raise ValueError(f"{where} must contain only str captions, got {type(s).__name__}")


def _fmt_ids(ids: Sequence[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(i) if not isinstance(i, int) else str(i) for i in list(ids)[:limit])
    return shown + (f" (and {len(ids) - limit} more)" if len(ids) > limit else "")


# --------------------------------------------------------------------------------------------
# COCO caption evaluation
# --------------------------------------------------------------------------------------------
# Characters that Java or the PTB lexer would treat as line breaks: they would shift the
# one-caption-per-line alignment, so they become spaces.
_LINE_BREAKS = str.maketrans({c: " " for c in "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def ptb_tokenize(captions: Mapping[Any, Sequence[str]]) -> dict[Any, list[str]]:
    """pycocoevalcap's PTBTokenizer (Stanford CoreNLP 3.4.1, lower-cased, punctuation removed).

    Same jar, options and punctuation filter as ``pycocoevalcap.tokenizer.ptbtokenizer``; the
    temporary file goes to the system temp directory (site-packages may be read-only), Java is
    told to use UTF-8, and the number of output lines is checked.
    """
    keys: list[Any] = []
    lines: list[str] = []
    for k, caps in captions.items():
        for c in caps:
            keys.append(k)
            lines.append(str(c).translate(_LINE_BREAKS))
    out: dict[Any, list[str]] = {k: [] for k in captions}
    if not lines:
        return out
    jar = os.path.join(os.path.dirname(os.path.abspath(ptb.__file__)), ptb.STANFORD_CORENLP_3_4_1_JAR)
    fd, tmp = tempfile.mkstemp(prefix="a2tune-ptb-", suffix=".txt")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write("\n".join(lines).encode("utf-8"))
        cmd = ["java", "-Dfile.encoding=UTF-8", "-cp", jar, "edu.stanford.nlp.process.PTBTokenizer",
               "-preserveLines", "-lowerCase", tmp]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except FileNotFoundError:
            raise A2Error("COCO evaluation needs Java (PTB tokenizer, METEOR): 'java' was not found") from None
    finally:
        os.remove(tmp)
    if proc.returncode != 0:
        raise A2Error(f"PTB tokenizer failed (exit {proc.returncode}): "
                           f"{proc.stderr.decode('utf-8', 'replace')[-2000:]}")
    token_lines = proc.stdout.decode("utf-8").split("\n")
    if len(token_lines) < len(lines):
        raise A2Error(f"PTB tokenizer returned {len(token_lines)} lines for {len(lines)} captions")
    punct = set(ptb.PUNCTUATIONS)
    for k, line in zip(keys, token_lines):
        out[k].append(" ".join(w for w in line.rstrip().split(" ") if w not in punct))
    return out


def _spice_lib_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(spice_pkg.__file__)), "lib")


def _spice_jars() -> list[str]:
    lib = _spice_lib_dir()
    return [os.path.join(lib, "stanford-corenlp-3.6.0.jar"), os.path.join(lib, "stanford-corenlp-3.6.0-models.jar")]


def spice_available() -> bool:
    """True when SPICE's Stanford CoreNLP jars are installed (SPICE can run offline)."""
    return all(os.path.isfile(p) for p in _spice_jars())


def _spice_missing_message() -> str:
    return (f"Stanford CoreNLP models not found under {_spice_lib_dir()} (needs a one-time download: "
            "`python -m pycocoevalcap.spice.get_stanford_models` with network access, or copy "
            "stanford-corenlp-3.6.0.jar and stanford-corenlp-3.6.0-models.jar there)")


def _progress(enabled: bool, msg: str) -> None:
    if enabled:
        print(f"coco_scores: {msg}", file=sys.stderr, flush=True)


class Meteor:
    """METEOR 1.5 with pycocoevalcap's jar and protocol (so its numbers), in a Java process this object owns::

        with Meteor() as meteor:            # the JVM loads its paraphrase table while other metrics run
            mean, per_image = meteor.compute_score(tok_gts, tok_res)

    pycocoevalcap's own wrapper stops its process only in `__del__` (which deadlocks after a failed call), so the
    process is started and stopped here."""

    def __enter__(self) -> "Meteor":
        cmd = ["java", "-jar", "-Xmx2G", pycoco.METEOR_JAR, "-", "-", "-stdio", "-l", "en", "-norm"]
        try:
            self.proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.abspath(pycoco.__file__)),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except FileNotFoundError:
            raise A2Error("COCO evaluation needs Java (METEOR): 'java' was not found") from None
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()

    def _ask(self, line: str, answers: int = 1) -> list[bytes]:
        self.proc.stdin.write(line.encode("utf-8") + b"\n")
        self.proc.stdin.flush()
        got = [self.proc.stdout.readline() for _ in range(answers)]
        if not all(got):  # end of file: the JVM died on this line (its stderr says why)
            raise OSError("METEOR's process ended")
        return got

    def compute_score(self, gts: dict, res: dict) -> tuple[float, list[float]]:
        """pycocoevalcap's interface: (mean, per-image scores in gts order); one caption per result."""
        stats, at = [], None
        try:
            for at in gts:  # `at`: the image whose caption METEOR was given when it failed (named in the error)
                stats.append(self._ask(" ||| ".join(("SCORE", " ||| ".join(gts[at]),
                                                      res[at][0].replace("|||", "").replace("  ", " "))))[0])
            at = None
            answers = self._ask(" ||| ".join(["EVAL", *(s.decode("utf-8").strip() for s in stats)]), len(stats) + 1)
            return float(answers[-1]), [float(a) for a in answers[:-1]]
        except (ValueError, OSError) as e:
            self.proc.kill()
            err = self.proc.stderr.read() or b""
            on = ("on the summary of all images" if at is None else
                  f"on image {at!r} (its caption has {len(res[at][0].split()):,} words)")
            lines = [line.strip() for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
            cause = next((line for line in lines if "Exception" in line or "Error" in line), lines[-1] if lines
                         else "no message")  # the JVM's one line, not its stack trace
            raise A2Error(f"METEOR failed {on} ({e}): {cause[:500]}") from None


def _check_inputs(gts: Mapping[Any, Sequence[str]], res: Mapping[Any, Any], where: str) -> tuple[list, dict]:
    """Same image ids on both sides, one caption per result; returns (ids in gts order, {id: [caption]})."""
    missing = [k for k in gts if k not in res]
    extra = [k for k in res if k not in gts]
    if missing:
        raise DataError(f"{where}: image id(s) {_fmt_ids(missing)} have references but no result "
                         f"({len(missing)} of {len(gts)} missing)")
    if extra:
        raise DataError(f"{where}: image id(s) {_fmt_ids(extra)} have a result but no references")
    ids = list(gts.keys())
    if not ids:
        raise DataError(f"{where}: no images to evaluate")
    one: dict[Any, list[str]] = {}
    for k in ids:
        r = res[k]
        if isinstance(r, (list, tuple)) and len(r) == 1:
            r = r[0]
        if not isinstance(r, str):
            raise DataError(f"{where}: the result of image {k!r} must be a caption string, got {r!r}")
        one[k] = [r]
        _check_ref_list(gts[k], f"{where}: references of image {k!r}")
    return ids, one


def _tokenized_scores(tok_gts: dict, tok_res: dict, meteor, progress: bool,
                      results: dict[str, float], per: dict[str, list[float]]) -> None:
    """BLEU-1..4, ROUGE-L, CIDEr (and METEOR when ``meteor`` is a started process) of tokenized captions."""
    num = len(tok_gts)
    _progress(progress, f"BLEU-1..4 on {num} images ...")
    bleu, bleu_per = Bleu(4).compute_score(tok_gts, tok_res, verbose=0)
    for i in range(4):
        results[f"BLEU-{i + 1}"] = float(bleu[i])
        per[f"BLEU-{i + 1}"] = [float(x) for x in bleu_per[i]]

    _progress(progress, f"ROUGE-L on {num} images ...")
    rouge, rouge_per = Rouge().compute_score(tok_gts, tok_res)
    results["ROUGE-L"], per["ROUGE-L"] = float(rouge), [float(x) for x in rouge_per]

    _progress(progress, f"CIDEr on {num} images ...")
    cider, cider_per = CiderD().compute_score(tok_gts, tok_res)
    results["CIDEr"], per["CIDEr"] = float(cider), [float(x) for x in cider_per]

    if meteor is not None:
        _progress(progress, f"METEOR on {num} images ...")
        results["METEOR"], per["METEOR"] = meteor.compute_score(tok_gts, tok_res)


def _assemble(ids: list, results: dict[str, float], per: dict[str, list[float]], per_image: bool) -> dict[str, Any]:
    """pycocoevalcap's fractions as the papers' x100 scores (the one place the scale is applied)."""
    order = [k for k in METRIC_NAMES if k in results]
    out: dict[str, Any] = {k: results[k] * SCALE for k in order}
    if per_image:
        out["per_image"] = {k: {name: per[name][i] * SCALE for name in order} for i, k in enumerate(ids)}
    return out


def coco_scores(
    gts: Mapping[int, Sequence[str]],
    res: Mapping[int, str],
    spice: bool | None = None,
    per_image: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """COCO caption metrics of raw (untokenized) captions.

    ``gts[image_id]`` = reference captions, ``res[image_id]`` = the generated caption (a str, or
    a one-element list). Returns ``{"BLEU-1".."BLEU-4", "METEOR", "ROUGE-L", "CIDEr"[, "SPICE"]}``
    on the x100 scale (pycocoevalcap's numbers x ``SCALE``: CIDEr 112.3 where pycocoevalcap says 1.123), plus
    ``"per_image": {image_id: {metric: value}}`` when ``per_image``.

    SPICE: ``spice=None`` runs it iff its Stanford CoreNLP jars are installed (otherwise one line
    on stderr says so); ``spice=True`` requires them (RuntimeError); ``spice=False`` skips it.
    """
    ids, raw_res = _check_inputs(gts, res, "coco_scores")
    if spice is None:
        run_spice = spice_available()
        if not run_spice:
            print(f"SPICE skipped: {_spice_missing_message()}", file=sys.stderr, flush=True)
    elif spice:
        if not spice_available():
            raise A2Error(f"SPICE was requested but cannot run: {_spice_missing_message()}")
        run_spice = True
    else:
        run_spice = False

    num = len(ids)
    t0 = time.perf_counter()
    results: dict[str, float] = {}
    per: dict[str, list[float]] = {}
    with Meteor() as meteor:  # its JVM starts up while the other metrics run
        _progress(progress, f"PTB tokenizer on {num} images ...")
        both = ptb_tokenize({**{("gts", k): gts[k] for k in ids}, **{("res", k): raw_res[k] for k in ids}})
        tok_gts = {k: both[("gts", k)] for k in ids}
        tok_res = {k: both[("res", k)] for k in ids}
        _tokenized_scores(tok_gts, tok_res, meteor, progress, results, per)

    if run_spice:
        _progress(progress, f"SPICE on {num} images ...")
        try:
            spice_mean, spice_sets = Spice().compute_score(tok_gts, tok_res)
        except (subprocess.CalledProcessError, OSError, ValueError, KeyError) as e:
            if spice:
                raise A2Error(f"SPICE failed: {e}") from None
            print(f"SPICE skipped: it failed ({e})", file=sys.stderr, flush=True)
        else:
            by_id = dict(zip(sorted(ids), spice_sets))
            results["SPICE"] = float(spice_mean)
            per["SPICE"] = [float(by_id[k]["All"]["f"]) for k in ids]
    out = _assemble(ids, results, per, per_image)
    _progress(progress, "done in %.1f s: %s" % (time.perf_counter() - t0, ", ".join(
        f"{k} {v:.2f}" for k, v in out.items() if k != "per_image")))
    return out


def caption_scores(
    gts: Mapping[int, Sequence[str]],
    res: Mapping[int, str],
    meteor: bool = False,
    per_image: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """COCO metrics of already tokenized captions (no PTB tokenizer), for validation in training.

    Returns ``{"BLEU-1".."BLEU-4", "ROUGE-L", "CIDEr"}`` (x100) and, with ``meteor=True``, "METEOR"
    (one Java process); same numbers as :func:`coco_scores` on the tokenized text. Captions
    are only whitespace-normalised.
    """
    ids, one = _check_inputs(gts, res, "caption_scores")
    tok_gts = {k: [" ".join(c.split()) for c in gts[k]] for k in ids}
    tok_res = {k: [" ".join(one[k][0].split())] for k in ids}
    results: dict[str, float] = {}
    per: dict[str, list[float]] = {}
    with Meteor() if meteor else contextlib.nullcontext() as proc:
        _tokenized_scores(tok_gts, tok_res, proc, progress, results, per)
    return _assemble(ids, results, per, per_image)


def _read_json(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise DataError(folder_instead(path, f"{what} file") or f"{what} file not found: {path}")
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # json recurses per nesting level: a hostile file nests beyond the interpreter's limit
        raise DataError(f"{path}: not valid {what} JSON (nested too deep to read)") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_SPLITS = {"train": {"train", "restval"}, "restval": {"restval"}, "val": {"val"}, "test": {"test"}}


def load_split_references(captions_path: str | os.PathLike, split: str = "test") -> dict[int, list[str]]:
    """``{cocoid: [raw caption, ...]}`` of one Karpathy split (``train`` includes ``restval``)."""
    path = os.fspath(captions_path)
    if split not in _SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {sorted(_SPLITS)}")
    data = _read_json(path, "captions")
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        raise DataError(f"{path}: expected Karpathy's format {{\"images\": [...]}}")
    wanted = _SPLITS[split]
    gts: dict[int, list[str]] = {}
    for i, img in enumerate(images):
        if not isinstance(img, dict):
            raise DataError(f"{path}: images[{i}] is not an object")
        if img.get("split") not in wanted:
            continue
        cid = img.get("cocoid")
        if not _is_int(cid):
            raise DataError(f"{path}: images[{i}] has no integer 'cocoid' (got {cid!r})")
        if cid in gts:
            raise DataError(f"{path}: image id {cid} appears twice in split {split!r}")
        sents = img.get("sentences")
        if not isinstance(sents, list) or not sents:
            raise DataError(f"{path}: image id {cid} has no 'sentences'")
        caps = []
        for j, s in enumerate(sents):
            raw = s.get("raw") if isinstance(s, dict) else None
            if not isinstance(raw, str):
                toks = s.get("tokens") if isinstance(s, dict) else None
                if not isinstance(toks, list) or not all(isinstance(t, str) for t in toks):
                    raise DataError(f"{path}: image id {cid}, sentences[{j}] has neither 'raw' nor 'tokens'")
                raw = " ".join(toks)
            caps.append(raw)
        gts[cid] = caps
    if not gts:
        raise DataError(f"{path}: no images in split {split!r}")
    return gts


def load_results(results_path: str | os.PathLike) -> dict[int, str]:
    """``{image_id: caption}`` from a COCO results JSON ``[{"image_id": int, "caption": str}, ...]``."""
    path = os.fspath(results_path)
    data = _read_json(path, "results")
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of {{\"image_id\": int, \"caption\": str}}")
    res: dict[int, str] = {}
    dups: list[int] = []
    for i, r in enumerate(data):
        if not isinstance(r, dict):
            raise DataError(f"{path}: entry {i} is not an object")
        iid, cap = r.get("image_id"), r.get("caption")
        if not _is_int(iid):
            raise DataError(f"{path}: entry {i} has no integer 'image_id' (got {iid!r})")
        if not isinstance(cap, str):
            raise DataError(f"{path}: entry {i} (image id {iid}) has no string 'caption'")
        if iid in res:
            dups.append(iid)
        res[iid] = cap
    if dups:
        raise DataError(f"{path}: duplicate image id(s) {_fmt_ids(sorted(set(dups)))}")
    return res


def evaluate_results_file(
    results_path: str | os.PathLike,
    captions_path: str | os.PathLike,
    split: str = "test",
    per_image: bool = False,
    spice: bool | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Score a COCO results JSON against the ``raw`` references of a Karpathy split.

    References are the ``raw`` sentences (``" ".join(tokens)`` where ``raw`` is missing) of the
    images of ``split`` (``train`` includes ``restval``); every image of the split needs exactly
    one result and every result must belong to the split.
    """
    if split not in _SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {sorted(_SPLITS)}")
    res = load_results(results_path)
    gts = load_split_references(captions_path, split)
    missing = [k for k in gts if k not in res]
    if missing:
        raise DataError(f"{os.fspath(results_path)}: no caption for image id(s) {_fmt_ids(missing)} of split "
                         f"{split!r} in {os.fspath(captions_path)} ({len(missing)} of {len(gts)} missing)")
    extra = [k for k in res if k not in gts]
    if extra:
        raise DataError(f"{os.fspath(results_path)}: image id(s) {_fmt_ids(extra)} are not in split {split!r} "
                         f"of {os.fspath(captions_path)}")
    try:
        return coco_scores(gts, {k: res[k] for k in gts}, spice=spice, per_image=per_image, progress=progress)
    except A2Error as err:  # a scorer that failed (METEOR out of memory on a runaway caption): name the file
        raise (DataError if isinstance(err, DataError) else A2Error)(f"{os.fspath(results_path)}: {err}") from None


# --------------------------------------------------------------------------------------------
# Baseline: the best single caption for every image
# --------------------------------------------------------------------------------------------
_PUNCT = str.maketrans({c: " " for c in ".,!?;:\"()[]{}`"})


def simple_tokenize(caption: str) -> str:
    """Lower-case, drop common punctuation, collapse whitespace (a light PTB stand-in)."""
    return " ".join(caption.lower().translate(_PUNCT).split())


def best_constant_caption(
    train_captions: Sequence[str], gts: Mapping[int, Sequence[str]], candidates: int = 50
) -> tuple[str, float]:
    """The caption that scores the highest CIDEr-D when used for every image of ``gts``.

    Candidates are the ``candidates`` most frequent training captions after
    :func:`simple_tokenize` (which is also applied to ``gts``); df comes from ``gts``. Returns
    ``(caption, CIDEr-D x100)``; ties go to the more frequent caption.
    """
    if candidates < 1:
        raise DataError(f"best_constant_caption: candidates must be >= 1, got {candidates}")
    counts = collections.Counter(t for t in (simple_tokenize(c) for c in train_captions) if t)
    if not counts:
        raise DataError("best_constant_caption: no non-empty training captions")
    if not gts:
        raise DataError("best_constant_caption: gts is empty")
    pool = [c for c, _ in counts.most_common(candidates)]
    refs = [[simple_tokenize(c) for c in gts[k]] for k in gts]
    per_cand = CiderD()._constant_many(pool, refs)
    means = [float(np.mean(s)) for s in per_cand]
    best = int(np.argmax(means))
    return pool[best], means[best] * SCALE
