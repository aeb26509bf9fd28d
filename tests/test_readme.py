"""The README's map of the code matches train_rlvr.py and credit.py, and every relative link of the docs resolves.

The map is a table (section | what lives there), with no line numbers. A section of train_rlvr.py is a line
`# ----...` followed by `# <Section name>`; it runs from that marker line to the line before the next marker
(or the file's last line). `python tests/test_readme.py` prints each section's lines as the file has them now.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SOURCE = ROOT / "train_rlvr.py"
CREDIT = ROOT / "credit.py"
MAP_HEADER = "| section | what lives there |"
SPEC_PATH_LINES = 950  # the spec's path, from the top of train_rlvr.py to the end of run


def file_sections(source: Path = SOURCE) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of every section of the file, in file order, 1-based."""
    lines = source.read_text(encoding="utf-8").splitlines()
    starts = [(i + 1, lines[i + 1][2:].strip()) for i in range(len(lines) - 1)
              if re.fullmatch(r"# -{10,}", lines[i]) and lines[i + 1].startswith("# ")]
    ends = [start - 1 for start, _ in starts[1:]] + [len(lines)]
    return [(name, start, end) for (start, name), end in zip(starts, ends)]


def readme_map(readme: Path = README) -> list[tuple[str, list[str]]]:
    """(section, names in backticks of "what lives there") per row of the README's map table."""
    text = readme.read_text(encoding="utf-8")
    assert MAP_HEADER in text, f"README has no map table (a table headed {MAP_HEADER!r})"
    rows = []
    for line in text.split(MAP_HEADER, 1)[1].splitlines()[2:]:  # after the header and |---|
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 2, f"README map: row {line!r} should have 2 cells (no line numbers)"
        rows.append((cells[0], re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", cells[1])))
    return rows


def definitions(source: Path = SOURCE) -> dict[str, list[int]]:
    """Line numbers of every `def NAME` / `class NAME` (methods too) of the file."""
    found: dict[str, list[int]] = {}
    for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        m = re.match(r"\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_][A-Za-z_0-9]*)", line)
        if m:
            found.setdefault(m[1], []).append(n)
    return found


def test_the_readme_map_lists_every_section_in_file_order():
    in_file = [name for name, _, _ in file_sections()]
    in_readme = [name for name, _ in readme_map()]
    assert in_readme == in_file, (f"README map: the sections should be train_rlvr.py's, in file order:\n"
                                  f"  train_rlvr.py: {in_file}\n  README:        {in_readme}")


def test_each_name_in_the_readme_map_is_defined_in_its_section():
    defined, spans = definitions(), {name: (a, b) for name, a, b in file_sections()}
    problems = []
    for section, names in readme_map():
        assert names, f"README map: section {section} names no function or class"
        a, b = spans.get(section, (0, -1))
        for name in names:
            where = defined.get(name, [])
            if name != "credit" and not any(a <= n <= b for n in where):
                at = f"defined at line {', '.join(map(str, where))}" if where else "not defined in train_rlvr.py"
                problems.append(f"README map: {name} (section {section}) is {at}")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def test_every_relative_link_of_the_readme_and_docs_points_to_an_existing_file():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code is not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: link {target!r}"
            if not file.exists():
                broken.append(f"{where} points to {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}, "
                              f"which does not exist")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{where}: {file.name} has no heading with the anchor #{anchor}")
    assert not broken, "\n".join(broken)


def test_the_functions_the_docs_name_in_their_headings_and_the_spec_path_are_defined():
    """A docs heading's trailing (`name`, ...) names the functions of train_rlvr.py or credit.py that hold its
    formula: each is defined there (a rename or a move that forgets a page fails here). And the spec's path ends
    where the README's map says: `run` within the first 950 lines, every function of both files at most 60 lines."""
    defined = definitions() | definitions(CREDIT)
    stale = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for heading in re.findall(r"^#{1,6}\s+(.*\))\s*$", page.read_text(encoding="utf-8"), re.M):
            names = re.findall(r"`([a-z_][a-z0-9_]*)`", heading[heading.rindex("("):])
            stale += [f"{page.name}: {heading!r} names {n}, which train_rlvr.py does not define"
                      for n in names if n not in defined and "_" in n]
    assert not stale, "\n".join(stale)
    run = next(n for n in ast.parse(SOURCE.read_text(encoding="utf-8")).body if getattr(n, "name", "") == "run")
    assert run.end_lineno <= SPEC_PATH_LINES, f"the spec's path ends at line {run.end_lineno}"
    long = [f"{path.name} {n.name}: {n.end_lineno - n.lineno + 1} lines" for path in (SOURCE, CREDIT)
            for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_credit_py_stands_alone():
    """credit.py, like verifier.py, imports nothing from the trainer (the trainer hands it plain values)."""
    for path in (CREDIT, ROOT / "verifier.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"train_rlvr", "credit", "verifier"} - {path.stem}, (path.name, imported)


if __name__ == "__main__":
    for name, start, end in file_sections():
        print(f"{name}: {start}-{end}")
