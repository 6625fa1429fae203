"""The submission check's line-break rule, tested against what the COCO server's tokenizer does: pycocoevalcap's own
PTBTokenizer (Java's Stanford PTB lexer) is run on captions holding each character Python splits lines at, and the
check must refuse exactly the characters that make the tokenizer shift captions onto other images. Needs Java."""
from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from dashboards.submission import results_filename, validate_zip

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")]

# Every character str.splitlines() splits at, but "\n" (which pycocoevalcap replaces with a space itself).
PYTHON_LINE_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
CAPTIONS = ["a dog runs", "a cat sits", "two men ride"]


def server_tokens(captions: list[str]) -> list[str]:
    """The tokens pycocoevalcap's PTBTokenizer gives each caption, in order (image i holds captions[i])."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
    tokens = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(captions)})
    return [tokens[i][0] for i in range(len(captions))]


def refused_as_line_break(tmp_path, caption: str) -> bool:
    val = [{"image_id": i, "caption": c} for i, c in enumerate([caption, *CAPTIONS[1:]], start=1)]
    test = [{"image_id": 100, "caption": "a horse"}]
    path = tmp_path / "results.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(results_filename("val", "a2"), json.dumps(val, ensure_ascii=False).encode("utf-8"))
        zf.writestr(results_filename("test", "a2"), json.dumps(test).encode("utf-8"))
    report = validate_zip(path, [1, 2, 3], [100], alg="a2")
    assert report.kinds() in ([], ["caption_line_break"]), str(report)
    return report.kinds() == ["caption_line_break"]


def test_the_check_refuses_exactly_the_characters_that_shift_the_servers_captions(tmp_path):
    """Before, U+001C-U+001E and U+0085 were refused too: captions the server reads on their own line, as the lexer
    shows (it keeps "a dog runs" on image 0). The five it splits (CR, VT, FF, U+2028, U+2029) stay refused."""
    assert server_tokens(CAPTIONS) == CAPTIONS  # the baseline: each caption on its own image
    shifting, refused = set(), set()
    for char in PYTHON_LINE_BREAKS:
        caption = f"a dog{char}runs"
        tokens = server_tokens([caption, *CAPTIONS[1:]])
        if tokens[1] != CAPTIONS[1]:  # the caption's second half became image 1's caption
            assert tokens[:2] == ["a dog", "runs"], (repr(char), tokens)
            shifting.add(char)
        else:
            assert tokens == CAPTIONS, (repr(char), tokens)
        if refused_as_line_break(tmp_path, caption):
            refused.add(char)
    assert shifting == set("\r\x0b\x0c\u2028\u2029")
    assert refused == shifting


def test_a_plain_newline_is_joined_by_the_tokenizer_and_accepted(tmp_path):
    """pycocoevalcap replaces "\\n" itself, so the check lets it through."""
    assert server_tokens(["a dog\nruns", *CAPTIONS[1:]]) == CAPTIONS
    assert not refused_as_line_break(tmp_path, "a dog\nruns")
