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


def test_the_study_file_and_config_reference_list_every_key(site):
    config, study = a2ref._sections()
    study_page, config_page = _text(site / "reference" / "study-file.html"), _text(site / "reference" / "config.html")
    for key, field, _model in a2ref.walk(study):
        assert key in study_page, f"{key} missing from the study-file reference"
    for key, field, _model in a2ref.walk(config):
        if key.count("."):
            assert key in config_page and field.description.split("`")[0].strip()[:30] in config_page, key
    assert "search.scheduler.asha.min_gap_se" in study_page and ">= 0" in study_page


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


def test_the_api_reference_renders_a2core_docstrings(site):
    page = _text(site / "reference" / "api.html")
    for name in ("a2core.train.train", "a2core.model.a2.build_model", "a2core.checkpoint.load_ensemble",
                 "a2core.metrics.coco_scores", "a2core.errors.ConfigError"):
        assert name in page, name


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
