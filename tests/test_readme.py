"""The README's promises stay true: the two commands, and the formats table matches the registry."""
import re
from pathlib import Path

from qatfactory.formats.__main__ import markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_shows_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_formats_table_matches_registry():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- formats-table -->\n(.*?)\n<!-- /formats-table -->", text, re.S)
    assert m, "README lost its formats table markers"
    assert m.group(1).strip() == markdown_table().strip(), (
        "README formats table is out of date: regenerate it with `python -m qatfactory.formats`")
