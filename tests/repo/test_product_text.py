"""No product file names a session, an issue or pull request of this project by number, device time, a lent
machine, ../shared, a device call's ``$OUT`` or ``carry [...]``, or a design file the repository does not hold; and
no docs heading carries a date. Product files: README.md, docs/, configs/, and the comments and string literals
(docstrings included) of artcache/, trainers/ and bench/ (their shell scripts whole). History goes to CHANGELOG.md,
which is not checked. Another project's issue or pull request ("vLLM issue #56792", "SpecForge PR #707") is fine:
:data:`FOREIGN` names the projects whose numbers may be cited."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = REPO

#: projects whose issues / pull requests a product file may cite by number, right before "issue" / "PR"
FOREIGN = re.compile(r"(?:vllm|sglang|specforge|speculators|transformers|pytorch|torch|msgspec|huggingface_hub|"
                     r"hugging face|mooncake|click|pytest|deepspec|z-lab|liger|triton|safetensors|llama\.cpp|cpython|"
                     r"python|flash-attn|flashinfer|github|hypothesis|ruff)(?:'s)?:? $", re.I)
ISSUE = re.compile(r"\b(?:issue|pr|pull request)s?[ -]#?\d+", re.I)
BANNED = re.compile("|".join([
    r"\bsessions?[ -]\d+", r"\b(?:this|next|last|previous|earlier|later|that) session\b",
    r"\bdevice[ -]time\b", r"\blent\b", r"\.\./shared\b", r"/work/shared\b", r"\$OUT\b", r"\bcarry \[",
    r"\bdevice calls?\b", r"\b(?:DESIGN|ALGORITHMS|REAL_INPUTS|SCALE_OUT)\.md\b",
]), re.I)
DATED_HEADING = re.compile(r"^#+ .*\b20\d\d-[01]\d-[0-3]\d\b")


def offences(line: str) -> list[str]:
    """The banned phrases in one line of product text."""
    found = [m.group(0) for m in BANNED.finditer(line)]
    found += [m.group(0) for m in ISSUE.finditer(line) if not FOREIGN.search(line[max(0, m.start() - 40):m.start()])]
    return found


def python_text(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and string literal (docstrings included) of a Python file."""
    out: list[tuple[int, str]] = []
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type in kinds:
            out += [(tok.start[0] + i, line) for i, line in enumerate(tok.string.splitlines())]
    return out


def product_lines() -> list[tuple[str, int, str]]:
    """(file, line number, text) of every product line the rule covers."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted(p for p in (ROOT / "configs").rglob("*") if p.is_file())]
    for d in ("artcache", "trainers", "bench"):
        texts += sorted(p for p in (ROOT / d).rglob("*.sh") if p.is_file())
    out = [(str(p.relative_to(ROOT)), n, line) for p in texts
           for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)]
    for d in ("artcache", "trainers", "bench"):
        for p in sorted((ROOT / d).rglob("*.py")):
            out += [(str(p.relative_to(ROOT)), n, line) for n, line in python_text(p)]
    return out


def test_no_product_file_names_a_session_an_issue_or_a_lent_machine():
    bad = [f"{f}:{n}: {hit!r}" for f, n, line in product_lines() for hit in offences(line)]
    assert not bad, "history belongs in CHANGELOG.md:\n" + "\n".join(bad)


def test_no_docs_heading_is_dated():
    bad = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
           for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if DATED_HEADING.match(line)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("line", [
    "Session 14 (2026-12-03, one lent H200)", "as issue 21 measured", "see issue #17, item 4", "the issue-14 command",
    "PR 12 fixed it", "bash ../shared/gpu/stage-smollm2.sh", "carry [\".stage-a\"]", "copied to $OUT/",
    "no device time was left", "DESIGN.md's lease rule", "configs/h200/s13-call1.sh, device call 2",
    "measured this session",
])
def test_the_rule_catches(line):
    assert offences(line), line


@pytest.mark.parametrize("line", [
    "vLLM issue #56792 describes it", "SpecForge PR #707 adds the recipe", "transformers issue 31337",
    "a session of its own (setsid)", "the lease is silent", "`Session.train_step`", "pytest's session fixture",
    "equivalent to the reference", "the issue is the window width",
])
def test_the_rule_allows(line):
    assert not offences(line), line
