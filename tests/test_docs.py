"""The README and docs/ are checked like code: every relative link leads to a
file and heading that exist, the README stays short, and every command block
marked runnable runs as written, at a tiny size (docs/tests.md, "The doc tests")."""
import os
import re
import shlex
import sys

import pytest

from conftest import ROOT, run_bounded

PAGES = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                               if name.endswith(".md"))
README_MAX_LINES = 250

# Appended to every train.py command of a runnable block that trains (later flags win):
# the tiny preset, a short sequence, two iterations, a short closing sample.
RUNNABLE_FLAGS = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
                  "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "2", "--eval-iters", "1",
                  "--sample-tokens", "8"]
RUNNABLE_MARK = "<!-- runnable -->"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are not checked
FENCE = re.compile(r"^(```|~~~)")


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def unfenced(text: str) -> str:
    """The lines of a Markdown text outside its fenced code blocks."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return "\n".join(lines)


def prose(text: str) -> str:
    """The text outside code, fenced or inline, where a `[x](y)` is a link."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, inline markup dropped, every
    character but letters, digits, spaces, '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a Markdown text (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    for line in unfenced(text).split("\n"):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = anchor(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


def link_problems(page: str) -> list[str]:
    """Every relative link of PAGE that names no file, or no heading of it."""
    problems = []
    for target in LINK.findall(prose(read(page))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked here
            continue
        path, _, fragment = target.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(full):
            problems.append(f"{page}: {target}: no file {os.path.relpath(full, ROOT)}")
        elif fragment and (not full.endswith(".md") or fragment not in anchors(read(os.path.relpath(full, ROOT)))):
            problems.append(f"{page}: {target}: no heading #{fragment} in {os.path.relpath(full, ROOT)}")
    return problems


def runnable_blocks(page: str) -> list[str]:
    """The bash blocks of PAGE that follow a `<!-- runnable -->` line."""
    lines, blocks = read(page).split("\n"), []
    for i, line in enumerate(lines[:-1]):
        if line.strip() == RUNNABLE_MARK:
            assert lines[i + 1].strip() == "```bash", f"{page}:{i + 1}: {RUNNABLE_MARK} must precede a ```bash block"
            end = lines.index("```", i + 2)
            blocks.append("\n".join(lines[i + 2:end]))
    return blocks


def tiny(block: str) -> str:
    """BLOCK with RUNNABLE_FLAGS appended to each train.py command that trains
    (one ending in a backslash goes on to the next line; before a ` # ` comment)."""
    commands = []
    for command in block.replace("\\\n", " ").split("\n"):
        if re.search(r"\btrain\.py\b", command) and "--export-from" not in command:
            command, hash_, comment = command.partition(" # ")
            command = f"{command.rstrip()} {shlex.join(RUNNABLE_FLAGS)}{' ' + hash_ + comment if hash_ else ''}"
        commands.append(command)
    return "\n".join(commands)


@pytest.mark.quick
def test_every_relative_link_names_a_file_and_heading_that_exist():
    """A reader who follows a link of the README or of docs/ lands on a file of
    the checkout, at the heading it names."""
    assert anchor("The README's default run (`bash run.sh`) on CPU") == "the-readmes-default-run-bash-runsh-on-cpu"
    assert anchor("Tests: 2 tiers, `-m quick`") == "tests-2-tiers--m-quick"
    problems = [problem for page in PAGES for problem in link_problems(page)]
    assert not problems, "\n".join(problems)


@pytest.mark.quick
def test_the_readme_is_short_and_says_how_to_run_it_and_test_it():
    """The README is the way in (at most 250 lines); the reference is in
    docs/, and every page of docs/ is linked from the README or another page."""
    readme = read("README.md")
    assert len(readme.split("\n")) <= README_MAX_LINES, f"README.md: {len(readme.splitlines())} lines"
    ci_command = read(".ci/run").strip().split("\n")[-1]  # CI runs what the README says
    assert "bash run.sh" in readme and ci_command in readme and f"{ci_command} -m quick" in readme
    linked = {os.path.normpath(os.path.join(os.path.dirname(page), target.partition("#")[0]))
              for page in PAGES for target in LINK.findall(prose(read(page)))}
    assert not [page for page in PAGES[1:] if page not in linked], "pages no other page links to"


@pytest.mark.quick
def test_the_readmes_reading_figures_are_what_bench_reading_lines_counts():
    """README's "Reading the code" gives, for each idea, the lines of its
    textbook core: each figure is bench/reading_lines.py's count within its
    TOLERANCE, and each peer's figure is the script's, so an edit that grows
    a core past the README's word fails here until the README says so."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import reading_lines
    rows = dict(re.findall(r"^\| ([^|]+?) \| (\d+) \| [^|]*\|$", read("README.md"), re.M))
    counted = reading_lines.counts()
    assert set(rows) == set(counted), "README's reading figures name other ideas than bench/reading_lines.py"
    for idea, n in counted.items():
        assert abs(int(rows[idea]) - n) <= reading_lines.TOLERANCE * n, f"{idea}: README says {rows[idea]}, " \
            f"bench/reading_lines.py counts {n}: update README.md"
        peer = reading_lines.CORES[idea][1]
        assert not peer or re.search(rf"^\| {re.escape(idea)} \| \d+ \| .*: {peer[0]} \|$", read("README.md"), re.M)


@pytest.mark.slow
def test_every_runnable_block_runs_at_a_tiny_size(tmp_path):
    """The commands marked runnable (the README's quick start by hand, and the
    pages' commands on its checkpoint) run as written, in order, in one
    directory, with train.py's runs made tiny."""
    for name in os.listdir(ROOT):
        if name.endswith(".py"):  # the programs, where a reader runs them: beside the data they write
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", "")}
    ran = 0
    for page in PAGES:
        for block in runnable_blocks(page):
            proc = run_bounded(["bash", "-euo", "pipefail", "-c", tiny(block)], 300, cwd=tmp_path, env=env)
            assert proc.returncode == 0, f"{page}:\n{block}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
            ran += 1
    assert ran >= 4 and (tmp_path / "checkpoints/shakespeare/latest_checkpointed_iteration.txt").exists()
