"""README.md's table of MoE families (tests/moe_families.py): one row for every MoE family of the
installed transformers (exactly, on the release the table was written for; a subset of it on
older ones), and each row's status is what the trial finds: "served" and "trial" rows decode
through the Engine as transformers' generate does, "refused" rows are refused by the adapters,
"untested" rows have no tiny model in the trial."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import transformers  # noqa: E402
from moe_families import moe_families, trial  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_RELEASE = "5.25"            # the release README's table describes (what CI installs newest)
EXPECT = {"served": "engine", "trial": "engine", "engine only": "engine",
          "refused": "adapter-refused", "untested": "no-tiny-model"}


def readme_rows() -> dict[str, str]:
    text = README.read_text()
    body = text[text.index("<!-- moe-families:start -->"):text.index("<!-- moe-families:end -->")]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| ([a-z ]+) \|", body, flags=re.M)
    assert rows, "README's MoE family table has no rows"
    return dict(rows)


def _on_table_release() -> bool:
    return ".".join(transformers.__version__.split(".")[:2]) == TABLE_RELEASE


def test_readme_has_a_row_for_every_moe_family():
    rows = readme_rows()
    assert set(rows.values()) <= set(EXPECT), sorted(set(rows.values()) - set(EXPECT))
    found = set(moe_families())
    missing = sorted(found - set(rows))
    assert not missing, (f"transformers {transformers.__version__} has MoE families README.md's "
                         f"table lacks: {missing}; run `python tests/moe_families.py "
                         f"{' '.join(missing)}` and add their rows")
    if _on_table_release():
        extra = sorted(set(rows) - found)
        assert not extra, f"README.md lists families transformers {TABLE_RELEASE} lacks: {extra}"


@pytest.mark.parametrize("family", sorted(readme_rows()))
def test_each_row_is_what_the_trial_finds(family):
    if not _on_table_release():
        pytest.skip(f"the table describes transformers {TABLE_RELEASE}, "
                    f"{transformers.__version__} is installed")
    status = readme_rows()[family]
    outcome, detail = trial(family)
    assert outcome == EXPECT[status], f"{family}: README says {status!r}, the trial: {outcome} " \
                                      f"({detail})"
