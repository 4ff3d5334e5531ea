"""Repository-wide rules: no dates or task numbers under hpa/, experiment records that say how to reproduce them,
a short results page, relative links in the docs that resolve (files and heading anchors), and few function-level
imports of hpa's own modules, each with its reason."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a date, or a re-drawn task's number ("hackable 117"): provenance belongs in experiments/, not in the product
DATED = re.compile(r"hackable [0-9]+|20[0-9]{2}-[0-9]{2}-[0-9]{2}")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
# an import of an hpa module inside a function hides the module's dependencies from its header; it is kept only
# where it breaks an import cycle or defers a heavy or optional dependency, and its comment says which
# (docs/design.md, rule 17)
MAX_FUNCTION_LEVEL_IMPORTS = 40
IMPORT_REASON = re.compile(r"#.*\b(cycle|defers?|optional)\b")


def dated_lines(root: Path):
    """Every ``path:line`` under ``root / "hpa"`` that ``grep -rE`` with ``DATED`` would print."""
    hits = []
    for path in sorted((root / "hpa").rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DATED.search(line):
                hits.append(f"{path.relative_to(root)}:{number}")
    return hits


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path):
    seen, out, fenced = {}, set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6} (.*)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def broken_links(root: Path, pages):
    """``page: target`` for each relative link of ``pages`` whose file, or whose ``#anchor``, does not exist."""
    broken = []
    for page in pages:
        fenced = False
        for line in page.read_text().splitlines():
            if FENCE.match(line):
                fenced = not fenced
                continue
            if fenced:
                continue
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(root)}: {target}")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_no_dates_or_task_numbers_under_hpa():
    assert dated_lines(ROOT) == [], "name the record under experiments/ instead of a date or a task number"


def test_the_date_rule_sees_what_grep_sees(tmp_path):
    # guards the walk above: a date and a task number are found, a task count and a version are not
    (tmp_path / "hpa" / "config").mkdir(parents=True)
    (tmp_path / "hpa" / "config" / "x.py").write_text('"""since 2026-11-27"""\n# hackable 40\n# 12 hackable tasks, 0.16.1\n')
    assert dated_lines(tmp_path) == ["hpa/config/x.py:1", "hpa/config/x.py:2"]


def test_slug_follows_githubs_anchors():
    assert slug("Ablations: `hpa ablate`") == "ablations-hpa-ablate"
    assert slug("The far rows' KL, measured (2026-11-27)") == "the-far-rows-kl-measured-2026-11-27"


def test_every_relative_link_of_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "experiments").glob("*.md"))]
    assert broken_links(ROOT, pages) == []


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n[ok](b.md#sub) [no file](c.md) [no anchor](b.md#nope) `[code](x.md)`\n")
    (tmp_path / "b.md").write_text("# B\n\n```\n# not a heading\n```\n## Sub\n")
    assert broken_links(tmp_path, [tmp_path / "a.md"]) == ["a.md: c.md", "a.md: b.md#nope (no such heading)"]


def test_results_page_is_short_and_every_record_says_how_to_reproduce_it():
    assert len((ROOT / "docs" / "results.md").read_text().splitlines()) <= 200
    index = (ROOT / "experiments" / "README.md").read_text()
    records = sorted(p for p in (ROOT / "experiments").glob("*.md") if p.name != "README.md")
    assert records
    for record in records:
        text = record.read_text()
        assert re.search(r"^- \*\*Date\*\*: 20\d\d-\d\d-\d\d$", text, re.M), record.name
        assert re.search(r"^- \*\*Commit\*\*: .*\b[0-9a-f]{7}\b", text, re.M), record.name
        assert re.search(r"^- \*\*Reproduce\*\*: \S", text, re.M), record.name
        assert f"({record.name})" in index, f"{record.name} is not in experiments/README.md"


def function_level_imports(root: Path):
    """``(path:line, reason)`` of each import of an hpa module (``hpa.*`` or relative) inside a function of
    ``root / "hpa"``; ``reason`` is the comment that gives it (``IMPORT_REASON``: on the import's own lines, or
    above the run of import lines it stands in) or None."""
    found = []
    for path in sorted((root / "hpa").rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        imports = {n for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        import_lines = {i for n in imports for i in range(n.lineno, n.end_lineno + 1)}
        for node in sorted(imports, key=lambda n: n.lineno):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if not (getattr(node, "level", 0) or any(name.split(".")[0] == "hpa" for name in names)):
                continue
            own = [lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)]
            above = node.lineno - 1
            while above in import_lines:
                above -= 1
            comments = [line for line in own if "#" in line]
            while above >= 1 and lines[above - 1].lstrip().startswith("#"):  # the comment block above the run
                comments.append(lines[above - 1])
                above -= 1
            reason = next((line.strip() for line in comments if IMPORT_REASON.search(line)), None)
            found.append((f"{path.relative_to(root)}:{node.lineno}", reason))
    return found


def test_function_level_imports_of_hpa_are_few_and_each_says_why():
    found = function_level_imports(ROOT)
    assert [where for where, reason in found if reason is None] == [], \
        "hoist the import to the module's header, or say why it is here (# breaks the cycle a -> b, # defers torch ..., # optional: ...)"
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS


def test_the_function_level_import_rule_reads_comments_and_runs_of_imports(tmp_path):
    (tmp_path / "hpa").mkdir()
    (tmp_path / "hpa" / "m.py").write_text(
        "import hpa.config\n\n\n"                                           # module level: not counted
        "def f():\n"
        "    import json\n"                                                  # not hpa: not counted
        "    from hpa.models import lora\n"                                  # 6: no reason
        "    from . import x  # optional: x\n"                               # 7: on its line
        "    # defers torch for the CLI,\n"
        "    # which starts in a moment\n"
        "    import torch\n"
        "    from hpa.engine import (a,\n"                                   # 11: above the run of imports
        "                            b)\n"
        "    from hpa.engine import c  # a note, no reason\n"                # 13: the run's comment above
        "    x = 1  # breaks the cycle a -> b\n"
        "    from hpa.trainer import d\n"                                    # 15: a comment on code is not one
        "    # a note\n"
        "\n"
        "    from hpa.data import e\n")                                      # 18: nor one a blank line away
    assert function_level_imports(tmp_path) == [
        ("hpa/m.py:6", None), ("hpa/m.py:7", "from . import x  # optional: x"),
        ("hpa/m.py:11", "# defers torch for the CLI,"), ("hpa/m.py:13", "# defers torch for the CLI,"),
        ("hpa/m.py:15", None), ("hpa/m.py:18", None)]
