"""Every ```bash block of README.md and of the docs pages runs as written, in order, in a copy of the repository.

The order is the README, then docs/tutorial.md, then the other pages of docs/ by path (`DOC_FILES`). A page marks
each block with the HTML comment line just above it:
- `<!-- readme-test: tiny -->`: run, with `TINY` (small sizes, one epoch) appended to every `a2 train`,
  `a2 study validate` and `a2 study run` line, so that the block finishes in minutes on 2 CPU cores;
- `<!-- readme-test: skip: REASON -->`: not run (it needs a cluster, a bucket, COCO files or the whole suite);
  the reason is printed as the skip reason;
- no comment: run exactly as written.

A block that starts Ray (`a2 study run`, `resume`, `pipeline`) runs inside this test: run the test under
`flock /tmp/a2-ray.lock` like every other test that starts Ray.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*readme-test:\s*(tiny|skip:\s*(?P<reason>.*?))\s*-->")
TINY = ("model.d_model=16 model.d_ff=32 model.layers=1 model.heads=2 train.xe_epochs=1 train.diag_images=10 "
        "train.diag_kendall_images=2 train.test_meteor=false data.val_images=20")
TINY_STUDY = "data.images=200 search.num_samples=1 search.scheduler.asha.grace_period=1"  # a study on its own (cached) synthetic set: smaller still
TAKES_OVERRIDES = ("a2 train ", "a2 study validate ", "a2 study run ")


def readme_blocks(text: str) -> list[dict]:
    """The ```bash blocks of `text`, in order: {"lines", "mode" ("tiny", "skip" or "as written"), "reason"}."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        match = MARKER.search(above)
        mode = "as written" if match is None else ("skip" if match.group("reason") is not None else "tiny")
        blocks.append({"lines": lines[i + 1:end], "mode": mode, "reason": match and match.group("reason")})
    return blocks


def tiny_script(lines: list[str]) -> str:
    """The block's lines with `TINY` overrides appended to the commands that take them (before any comment)."""
    out = []
    for line in lines:
        command, hash_, comment = line.partition(" #")
        if command.startswith(TAKES_OVERRIDES):
            extra = TINY + (" " + TINY_STUDY if command.startswith("a2 study ") else "")
            line = f"{command.rstrip()} {extra}" + (f"  #{comment}" if hash_ else "")
        out.append(line)
    return "\n".join(out)


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
def test_tiny_overrides_go_before_comments_and_only_where_taken():
    script = tiny_script(["a2 train --config x.yaml a=1   # note", "a2 decode --out r.json", "a2 study status s"])
    first, second, third = script.splitlines()
    assert first == f"a2 train --config x.yaml a=1 {TINY}  # note"
    assert second == "a2 decode --out r.json" and third == "a2 study status s"
    blocks = readme_blocks("<!-- readme-test: skip: needs S3 -->\n```bash\na2 x\n```\n\n```bash\na2 y\n```\n")
    assert [(b["mode"], b["reason"], b["lines"]) for b in blocks] == [("skip", "needs S3", ["a2 x"]),
                                                                      ("as written", None, ["a2 y"])]


def doc_files() -> list[Path]:
    """The README, the tutorial, then every other Markdown page of docs/ by path (all blocks share one clone)."""
    first = [REPO / "README.md", REPO / "docs" / "tutorial.md"]
    return first + sorted(p for p in (REPO / "docs").rglob("*.md") if p not in first)


DOC_FILES = doc_files()
BLOCKS = [dict(block, file=str(path.relative_to(REPO))) for path in DOC_FILES
          for block in readme_blocks(path.read_text())]
# What a block that ran must have left behind, by its first command.
LEFT_BEHIND = {
    "a2 data synth": ["data/synth/dataset_coco.json", "runs/a2/best.pt", "runs/a2/history.json", "results.json"],
    "a2 study validate": ["a2-studies/a2-smoke/summary.json", "a2-reports/a2-smoke/report.html"],
}


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files, as a fresh clone has them."""
    root = tmp_path_factory.mktemp("readme") / "a2tune"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    return root


def _block_id(index: int, block: dict) -> str:
    command = next((line for line in block["lines"] if not line.startswith("#")), "")
    return f"{block['file']}-block{index}-{command.split(' #')[0].strip()[:30]}"


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
def test_the_docs_pages_blocks_are_collected():
    files = {block["file"] for block in BLOCKS}
    assert "README.md" in files and "docs/tutorial.md" in files
    assert DOC_FILES[:2] == [REPO / "README.md", REPO / "docs" / "tutorial.md"]
    assert all(block["mode"] == "skip" for block in BLOCKS if block["file"] not in ("README.md", "docs/tutorial.md")), \
        "a block outside the README and the tutorial runs: keep the docs' run time what it is (mark it skip: REASON)"


# commands that start a local Ray: a block with none of them (`a2 data synth`, `a2 train`, `a2 decode`, `a2 evaluate`)
# runs beside the "ray" xdist group (tests/conftest.py fails it if it starts one after all)
RAY_COMMANDS = ("a2 study run", "a2 study resume", "a2 study rehearse", "a2 pipeline", "a2 package", "ray ",
                "python3 -m pytest")


def _block_param(index: int, block: dict):
    starts_ray = any(line.lstrip().startswith(RAY_COMMANDS) or " && a2 pipeline" in line for line in block["lines"])
    marks = () if starts_ray or block["mode"] == "skip" else (pytest.mark.outside_ray_group,)
    return pytest.param(index, marks=marks, id=_block_id(index, block))


@pytest.mark.parametrize("index", [_block_param(i, b) for i, b in enumerate(BLOCKS)])
def test_readme_block_runs_as_written(index, clone, tmp_path_factory):
    block = BLOCKS[index]
    if block["mode"] == "skip":
        pytest.skip(f"{block['file']} block {index}: {block['reason']}")
    script = tiny_script(block["lines"]) if block["mode"] == "tiny" else "\n".join(block["lines"])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray, as for a new user
    env.update(PYTHONPATH=str(clone), A2_DATA_CACHE=str(tmp_path_factory.mktemp("a2cache")),
               RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=clone, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800)
    assert done.returncode == 0, f"{block['file']} block {index} failed:\n{script}\n---\n{done.stdout[-6000:]}"
    assert "Traceback" not in done.stdout, done.stdout[-6000:]
    first = next(line for line in block["lines"] if not line.startswith("#"))
    for path in next((paths for start, paths in LEFT_BEHIND.items() if first.startswith(start)), []):
        assert (clone / path).is_file(), f"{block['file']} block {index} left no {path}"
    if first.startswith("a2 data synth"):  # the evaluation found a caption for every test image
        assert "CIDEr" in done.stdout and "missing" not in done.stdout
