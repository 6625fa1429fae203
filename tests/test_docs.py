"""The docs site builds in Sphinx's strict mode, offline, with its reference generated from the code; the README
stays short and points into it.

The build (`python3 -m sphinx -W --keep-going -b html docs OUT`) fails on any warning: a broken link or anchor, an
unknown reference, a docstring that is not valid reStructuredText, a config field without a description.
"""
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs" / "_ext"))
import a2ref  # noqa: E402  (the docs' generator: docs/_ext/a2ref.py)


def test_every_config_and_study_file_field_has_a_description():
    assert a2ref.undocumented_fields() == [], "add Field(description=...) to each; the reference page shows it"


def test_every_cli_option_positional_and_subcommand_has_help_text():
    """Walks the whole `a2` argparse tree (launch/cli.py builds all of it): the CLI reference shows each help
    string, and an empty one would be an empty cell."""
    assert a2ref.undocumented_options() == [], "add help=... to each; `a2 ... --help` and the reference show it"


def test_an_option_without_help_is_found_and_fails_the_strict_build(monkeypatch, caplog):
    import argparse
    import logging

    import launch.cli

    parser = argparse.ArgumentParser(prog="a2")
    sub = parser.add_subparsers(dest="command")
    tr = sub.add_parser("train", help="one run")
    tr.add_argument("--config", help="the config")
    tr.add_argument("--output-dir")
    tr.add_argument("overrides", nargs="*")
    tr.add_argument("--old", help=argparse.SUPPRESS)  # hidden on purpose: not a gap
    sub.add_parser("bare")
    assert a2ref.undocumented_options(parser) == ["a2 train --output-dir", "a2 train overrides", "a2 bare"]

    # The docs build (builder-inited) warns about each one; a warning fails `sphinx -W`.
    monkeypatch.setattr(launch.cli, "build_parser", lambda: parser)
    with caplog.at_level(logging.WARNING):
        a2ref._check_descriptions(None)
    warned = [r.getMessage() for r in caplog.records if "CLI option without help text" in r.getMessage()]
    assert warned == [f"CLI option without help text: {n} (add help=... to its add_argument)"
                      for n in ("a2 train --output-dir", "a2 train overrides", "a2 bare")]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs-html")
    # Offline: no proxy can reach anything, and nothing in the configuration fetches (no intersphinx, no web fonts).
    env = {**os.environ, "PYTHONPATH": str(REPO), "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(out / ".doctrees"), str(REPO / "docs"), str(out)],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, f"the strict docs build failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.mark.slow
def test_the_study_file_and_config_reference_list_every_key(site):
    config, study = a2ref._sections()
    study_page, config_page = _text(site / "reference" / "study-file.html"), _text(site / "reference" / "config.html")
    for key, field, _model in a2ref.walk(study):
        assert key in study_page, f"{key} missing from the study-file reference"
    for key, field, _model in a2ref.walk(config):
        if key.count("."):
            assert key in config_page and field.description.split("`")[0].strip()[:30] in config_page, key
    assert "search.scheduler.asha.min_gap_se" in study_page and ">= 0" in study_page


@pytest.mark.slow
def test_the_cli_reference_lists_every_subcommand_and_option(site):
    from launch.cli import build_parser

    page = _text(site / "reference" / "cli.html")

    def visit(words, parser):
        for action in parser._actions:
            for option in [] if action.dest == "help" else action.option_strings:
                assert option in page, f"{' '.join(words)} {option} missing from the CLI reference"
        for name, _help, sub in a2ref._subcommands(parser):
            assert " ".join(words + [name]) in page, f"{' '.join(words + [name])} missing from the CLI reference"
            visit(words + [name], sub)

    visit(["a2"], build_parser())
    # the help text is shown beside each option (rows of `a2 decode`, `a2 mlflow serve`, a study subcommand's name)
    for shown in ("beams per image (default 5)", "address to listen on (default 127.0.0.1",
                  "the study's name (its name: key)"):
        assert shown in page, f"{shown!r} missing from the CLI reference"


@pytest.mark.slow
def test_the_api_reference_renders_a2core_docstrings(site):
    page = _text(site / "reference" / "api.html")
    for name in ("a2core.train.train", "a2core.model.a2.build_model", "a2core.checkpoint.load_ensemble",
                 "a2core.metrics.coco_scores", "a2core.errors.ConfigError"):
        assert name in page, name


@pytest.mark.slow
def test_the_site_loads_nothing_from_the_network(site):
    remote = re.compile(r"""<(?:link|script|img)\b[^>]*\b(?:href|src)=["'](?:https?:)?//""", re.I)
    for page in site.rglob("*.html"):
        assert not remote.search(page.read_text()), f"{page.relative_to(site)} loads something from the network"
    for sheet in site.rglob("*.css"):
        assert not re.search(r"@import\s+url\(\s*['\"]?https?:|url\(\s*['\"]?https?://", sheet.read_text()), sheet


def test_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links into the docs"
    for link in local:
        assert (REPO / link).exists(), f"README links to {link}, which does not exist"
    assert any(link.startswith("docs/") for link in local)


def test_readmes_study_file_is_a_valid_study(tmp_path):
    from launch.spec import load_study

    text = (REPO / "README.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "study.yaml").write_text(block)
    spec = load_study(tmp_path / "study.yaml")
    assert spec.name == "a2-smoke" and spec.num_trials == 8  # 2 configurations x 4 seeds
    # "it is studies/smoke.yaml, shortened": every key it shows has smoke.yaml's value
    from a2core.config import flatten, load_yaml

    shown, smoke = flatten(load_yaml(tmp_path / "study.yaml")), flatten(load_yaml(REPO / "studies" / "smoke.yaml"))
    assert {k: v for k, v in shown.items() if smoke.get(k) != v} == {}


def test_readmes_command_table_names_every_command():
    from launch.cli import build_parser

    table = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `a2 ")]
    named = {line.split("`")[1] for line in table}

    def leaves(words, parser):
        subs = a2ref._subcommands(parser)
        if not subs:
            yield " ".join(words)
        for name, _help, sub in subs:
            yield from leaves(words + [name], sub)

    assert named == set(leaves(["a2"], build_parser()))


def test_the_landing_page_installs_runs_shows_and_cites():
    """What a researcher looks for first: install, the two commands, what comes out, the paper, the version."""
    import tomllib

    page = (REPO / "docs" / "index.md").read_text()
    headings = re.findall(r"^## (.+)$", page, flags=re.M)
    assert ["Install", "Two commands", "What you get", "The paper"] == headings[:4], headings
    assert "python3 -m venv" in page and "scripts/setup.sh" in page
    assert "a2 pipeline" in page and "python3 -m pytest -q" in page
    assert "@inproceedings{" in page and "Attention-Aligned Transformer for Image Captioning" in page
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert f"a2tune {version}" in page
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page):
        assert (REPO / "docs" / image).is_file(), image


# Pages written by a2ref from the code, not by hand: their layout is the generator's.
GENERATED_PAGES = {"reference/cli.md", "reference/config.md", "reference/study-file.md"}


def _pages() -> dict[str, str]:
    """Every hand-written page of docs/, by its path under docs/."""
    docs = REPO / "docs"
    return {str(page.relative_to(docs)): page.read_text() for page in sorted(docs.rglob("*.md"))
            if "_build" not in page.parts and str(page.relative_to(docs)) not in GENERATED_PAGES}


def _prose(markdown: str) -> str:
    """The page without its fenced blocks and HTML comments: what a reader reads as running text."""
    markdown = re.sub(r"^(```|~~~).*?^\1\s*$", "", markdown, flags=re.M | re.S)
    return re.sub(r"<!--.*?-->", "", markdown, flags=re.S)


def test_every_long_page_has_sections():
    """A page of more than 400 words is scanned by its `##` headings, not read as one wall of text."""
    walls = {}
    for name, text in _pages().items():
        prose = _prose(text)
        words = len(prose.split())
        if words > 400 and not re.search(r"^## \S", prose, flags=re.M):
            walls[name] = words
    assert walls == {}, f"pages of more than 400 words without a `##` heading (words): {walls}"


def test_every_image_a_page_references_exists():
    """Markdown images, {image}/{figure} directives and <img src=...>, each resolved against its page's folder."""
    missing, seen = [], 0
    for name, text in _pages().items():
        prose = _prose(text)
        targets = re.findall(r"!\[[^]]*\]\(\s*<?([^)\s>]+)", prose)
        targets += re.findall(r"^[`:]{3,}\{(?:image|figure)\}\s+(\S+)", text, flags=re.M)
        targets += re.findall(r"<img\b[^>]*\bsrc=[\"']([^\"']+)", prose)
        for target in targets:
            if re.match(r"[a-z]+://", target):
                missing.append(f"{name}: {target} is remote (the site loads nothing from the network)")
                continue
            seen += 1
            path = (REPO / "docs" / "index.md").parent / target.lstrip("/") if target.startswith("/") \
                else (REPO / "docs" / name).parent / target
            if not path.is_file():
                missing.append(f"{name}: {target}")
    assert missing == [], missing
    assert seen >= 5, "the MLflow screenshots are referenced from the how-to and the tutorial"


@pytest.mark.slow  # the strict Sphinx build (the `site` fixture)
def test_equations_render_from_mathjax_served_by_the_site(site):
    """$...$ and $$...$$ become MathJax markup, and MathJax is loaded from the site's own _static, not a CDN."""
    page = (site / "explanation" / "model.html").read_text()
    assert len(re.findall(r'class="math notranslate nohighlight"', page)) >= 10, "the paper's Eq. 2-10 as math"
    for tag in range(2, 6):
        assert rf"\tag{{{tag}}}" in page, f"Eq. {tag} is numbered as in the paper"
    assert r"\alpha^a_t = g_t \cdot \alpha_t + (1 - g_t) \cdot \alpha^m_t" in page  # Eq. 9, the gate
    stats = (site / "explanation" / "statistics.html").read_text()
    assert r"\operatorname{var}(A - B)" in stats and 'class="math' in stats
    scripts = re.findall(r"<script\b[^>]*\bsrc=[\"']([^\"']+)", page)
    mathjax = [src for src in scripts if "mathjax" in src.lower()]
    assert mathjax, f"no MathJax script on the model page: {scripts}"
    for src in scripts:
        assert not re.match(r"(?:https?:)?//", src), f"the model page loads the script {src} from the network"
        assert (site / "explanation" / src.split("?")[0]).resolve().is_file(), f"{src} is not in the built site"
    # The fonts MathJax's CommonHTML output asks for sit beside it (it loads them relative to its own script).
    assert list((site / "_static" / "mathjax" / "output" / "chtml" / "fonts").rglob("*.woff")), "MathJax's fonts"


@pytest.mark.slow  # the strict Sphinx build (the `site` fixture)
def test_images_link_to_their_full_size_file(site):
    page = (site / "how-to" / "compare-trials-in-mlflow.html").read_text()
    images = re.findall(r"<img\b[^>]*\bsrc=\"([^\"]+)\"", page)
    linked = re.findall(r"<a\b[^>]*class=\"[^\"]*image-reference[^\"]*\"[^>]*href=\"([^\"]+)\"[^>]*>\s*<img\b[^>]*"
                        r"\bsrc=\"([^\"]+)\"", page)
    assert len(images) == 4 and sorted(src for _href, src in linked) == sorted(images), (images, linked)
    for href, src in linked:
        assert href == src and (site / "how-to" / href).resolve().is_file(), href


@pytest.mark.slow  # the strict Sphinx build (the `site` fixture)
def test_no_interval_breaks_across_lines(site):
    """Every 95% interval in a table cell is one unbreakable span (a2.css: white-space: nowrap)."""
    assert "white-space: nowrap" in (site / "_static" / "a2.css").read_text()
    cells = 0
    for page in (site / "results" / "studies.html", site / "explanation" / "statistics.html"):
        html_text = page.read_text()
        assert "_static/a2.css" in html_text, f"{page.name} does not load a2.css"
        for cell in re.findall(r"<td\b[^>]*>(.*?)</td>", html_text, flags=re.S):
            bare = re.sub(r"<span class=\"a2-interval\">[^<]*</span>", "", cell)
            bare = re.sub(r"<code\b.*?</code>", "", bare, flags=re.S)  # a code span keeps its own text
            assert not re.search(r"\[[-+]?\d[\d.,]*%?, [-+]?\d[\d.,]*%?\]", bare), f"{page.name}: {cell[:200]}"
            cells += cell.count("a2-interval")
    assert cells >= 10, "the results tables hold intervals"


def test_the_generated_reference_pages_in_the_repository_are_current():
    """The study-file, config and CLI reference pages hold their generated Markdown in the repository (so they read
    on GitHub, where the README links to them), and it is what the code generates now."""
    pages = {p.name for p in a2ref.pages(REPO / "docs")}
    assert {"cli.md", "config.md", "study-file.md"} <= pages, pages
    stale = [str(p.relative_to(REPO)) for p in a2ref.stale_pages(REPO / "docs")]
    assert not stale, f"{stale}: out of date; run python3 docs/_ext/a2ref.py"
    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    assert "| `a2 study rehearse` |" in cli and "`--estimate`" in cli  # generated rows, not a marker
    study_file = (REPO / "docs" / "reference" / "study-file.md").read_text()
    # types and defaults as the loader takes them: an integer is accepted for replicates; neither scheduler is required
    assert "| `search.replicates` | integer, or list of integer, or {min, max, rounds}, or null |" in study_file
    assert "| `search.scheduler.asha` | mapping | one of `asha`, `fifo` |" in study_file


@pytest.mark.slow
def test_the_api_pages_example_runs_small_and_writes_only_its_own_folder(tmp_path):
    """The Python example of docs/reference/api.md runs as written (seconds, a tiny model) and leaves the folder it
    runs in untouched (its checkpoints go to a temporary folder of its own)."""
    page = (REPO / "docs" / "reference" / "api.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path / "tmp"), "HOME": str(tmp_path / "home")}
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "cwd", env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    best_epoch, test_cider = done.stdout.split()[-2:]
    assert best_epoch == "1" and float(test_cider) >= 0.0
    assert list((tmp_path / "cwd").iterdir()) == []  # nothing written where it ran
    [out] = (tmp_path / "tmp").glob("a2-api-*")
    assert (out / "best.pt").is_file()


# -- the paper's numbers, the Python example, pages that read on GitHub ---------------------------------------------
def test_the_papers_tables_are_on_a_page_generated_from_paper_results():
    """docs/results/paper.md holds Table 1 and Table 3 as a2ref generates them from dashboards/paper_results.py (the
    one copy of the paper's numbers; `test_the_generated_reference_pages_in_the_repository_are_current` fails while
    the page differs), every number of both tables among them."""
    from dashboards import paper_results as paper

    page = (REPO / "docs" / "results" / "paper.md").read_text()
    assert re.findall(r"^<!-- a2ref: (paper-table\d) -->$", page, flags=re.M) == ["paper-table3", "paper-table1"]
    table3 = page.split("<!-- a2ref: paper-table3 -->")[1].split("<!-- /a2ref -->")[0]
    for fusion, row in paper.TABLE3_ROW.items():
        shown = next(line for line in table3.splitlines() if line.startswith(f"| `{fusion}` |"))
        assert shown.split(" | ")[2:] == [f"{v:.1f}" for v in paper.TABLE3["rows"][row].values()][:-1] + \
            [f"{paper.TABLE3['rows'][row]['SPICE']:.1f} |"], shown
    table1 = page.split("<!-- a2ref: paper-table1 -->")[1].split("<!-- /a2ref -->")[0]
    assert "| A2 Transformer | 78.6 | 38.2 | 29.2 | 58.3 | 125.0 | 22.1 | 81.5 | 39.8 | 29.6 | 59.1 | 133.9 | 23.0 |" in table1
    assert "| DPA | - | - | - | - | - | - | - | 40.5 |" in table1  # a dash in the paper stays one


DOI = "10.1609/aaai.v36i1.19940"  # the paper's DOI, as the AAAI proceedings give it


def test_the_paper_is_linked_with_its_doi():
    """The landing page links the paper and its BibTeX carries the DOI and URL; the paper's results page links it."""
    index = (REPO / "docs" / "index.md").read_text()
    bibtex = re.search(r"@inproceedings\{.*?\n\}", index, flags=re.S).group(0)
    assert f"doi       = {{{DOI}}}" in bibtex and "url       = {https://doi.org/" + DOI + "}" in bibtex
    assert "pages     = {607--615}" in bibtex and "number    = {1}" in bibtex
    assert f"](https://doi.org/{DOI})" in _prose(index)
    assert f"https://doi.org/{DOI}" in (REPO / "docs" / "results" / "paper.md").read_text()
    assert f"https://doi.org/{DOI}" in (REPO / "README.md").read_text()


def test_the_python_pages_example_runs_on_a_stored_study(tmp_path):
    """docs/how-to/results-in-python.md's blocks, in order, as one script, against a study `a2-smoke` stored in
    ./a2-studies as `a2 study run` leaves it (four trials: fusion none and gate over two seeds)."""
    from tests.test_frames import stored_study

    stored_study(tmp_path, "a2-smoke", overrides=(f"storage={tmp_path / 'a2-studies'}",))
    page = (REPO / "docs" / "how-to" / "results-in-python.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 3
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "gate1" in out and "best_group" in out
    fusions = [line.split() for line in out.splitlines() if line.split()[:1] in (["gate"], ["none"])]
    assert ["gate", "94.5"] in [row[:2] for row in fusions] and ["none", "89.5"] in [row[:2] for row in fusions]


def test_every_page_shows_content_on_github():
    """A page GitHub shows as it is: none whose text is only a Sphinx `{include}` (GitHub renders the directive as
    a code block), and none that includes a file without also holding its own text."""
    bare = []
    for name, text in _pages().items():
        without = re.sub(r"^(```|~~~)\{include\}.*?^\1\s*$", "", text, flags=re.M | re.S)
        if "{include}" in text and len(_prose(without).split()) < 50:
            bare.append(name)
        if re.search(r"^(```|~~~)\{include\}", text, flags=re.M):
            bare.append(f"{name} (includes a file: GitHub shows the directive, not the file)")
    assert bare == [], bare


def test_the_readme_links_every_how_to_and_results_page():
    readme = (REPO / "README.md").read_text()
    for page in sorted((REPO / "docs" / "how-to").glob("*.md")) + sorted((REPO / "docs" / "results").glob("*.md")):
        assert f"(docs/{page.parent.name}/{page.name})" in readme, f"the README's documentation list lacks {page.name}"
