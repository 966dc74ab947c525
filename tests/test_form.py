"""The scripts' form, which the lesson depends on: size budgets, line width, `ruff format`, the nine
sections in order, standalone imports, sibling scripts that differ only in substance."""

import ast
import importlib.util
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from conftest import REPO

# The ceilings of "Minimal by choice" (code / total / main() lines), set from measured drafts: code is the
# characters without argparse `help=` strings, comments and docstrings; total adds back the comments and docstrings;
# main() is its lines. A ceiling is never raised: a change makes its own room.
CEILINGS = {
    "toy_linear.py": (8_500, 11_000, 110),
    "train_unconditional.py": (28_500, 39_000, 296),
    "train_dit.py": (34_500, 47_000, 346),
    "train_text_to_image.py": (39_000, 53_500, 395),
    "train_lora.py": (41_000, 56_000, 418),
}
# The Diffusers examples the scripts follow, measured the same way (shared/reference/diffusers_examples, the
# unmodified copies of Aug 2026): train_unconditional.py, train_text_to_image.py, train_text_to_image_lora.py.
DIFFUSERS_EXAMPLES = {
    "train_unconditional.py": (24_169, 27_087, 447),
    "train_text_to_image.py": (36_867, 42_543, 638),
    "train_lora.py": (32_716, 37_546, 583),
}
SIBLINGS = [  # (script, its parallel text, at most this many changed lines in `diff`)
    ("train_unconditional.py", "train_dit.py", 340),
    ("train_text_to_image.py", "train_lora.py", 350),
]
SECTIONS = ["1. Arguments", "2. Accelerator", "3. Model", "4. Data", "5. Optimizer", "6. ", "7. The training loop",
            "8. Validation", "9. Final save"]


def ruff():
    # The ruff installed beside this Python (the lock pins it), wherever that environment lies.
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert found, "ruff is in requirements.txt"
    return found


def sizes(text):
    """(code, total, main() lines) of a script. total: its characters with argparse `help=` keywords (help= and
    its string) deleted, nothing reformatted, so a help too long for its call's line still costs the lines that
    the call wraps onto; code: total less the text of comments and docstrings."""
    tree = ast.parse(text)
    helps = [k for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "add_argument"
             for k in n.keywords if k.arg == "help"]
    total = len(text) - sum(len(ast.get_source_segment(text, k)) for k in helps)
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    comments = sum(len(t.string) for t in tokens if t.type == tokenize.COMMENT)
    documented = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))]
    docstrings = sum(len(ast.get_source_segment(text, n.body[0])) for n in documented if n.body
                     and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
                     and isinstance(n.body[0].value.value, str))
    main = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    return total - comments - docstrings, total, main[0].end_lineno - main[0].lineno + 1 if main else 0


def test_sizes_delete_the_help_keyword_comments_and_docstrings_and_nothing_else():
    one_line = 'def f():\n    """Doc."""\n    p.add_argument("--a", type=int, help="What a does.")  # why\n'
    code, total, _ = sizes(one_line)
    assert total == len(one_line) - len('help="What a does."')
    assert code == total - len('"""Doc."""') - len("# why")
    wrapped = 'p.add_argument(\n    "--a",\n    type=int,\n    help="What a does.",\n)\n'
    assert sizes(wrapped)[1] == len('p.add_argument(\n    "--a",\n    type=int,\n    ,\n)\n')
    assert sizes("def main(args):\n    x = 1\n\n    return x\n")[2] == 4


@pytest.mark.parametrize("script", CEILINGS)
def test_size_and_line_width(script):
    text = (REPO / script).read_text()
    code, total, main_lines = sizes(text)
    ceiling = CEILINGS[script]
    assert code <= ceiling[0] and total <= ceiling[1] and main_lines <= ceiling[2], \
        f"code {code}, total {total}, main() {main_lines} lines: over {ceiling}"
    wide = [i + 1 for i, line in enumerate(text.splitlines()) if len(line) > 100]
    assert not wide, f"lines over 100 columns: {wide}"


def test_the_readme_states_the_sizes_this_test_measures():
    """The README's table of sizes against the Diffusers examples: every number is the one measured here."""
    readme = (REPO / "README.md").read_text()
    for script in ["train_unconditional.py", "train_dit.py", "train_text_to_image.py", "train_lora.py"]:
        code, total, main_lines = sizes((REPO / script).read_text())
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{script}` |"))
        expected = f"| `{script}` | {code:,} | {total:,} | {main_lines} |"
        example = DIFFUSERS_EXAMPLES.get(script)
        expected += f" {example[0]:,} | {example[1]:,} | {example[2]} |" if example else " — | — | — |"
        assert row == expected, (row, expected)


def test_ruff_format_leaves_the_scripts_unchanged():
    result = subprocess.run([ruff(), "format", "--check", "--line-length", "100", *CEILINGS], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", CEILINGS)
def test_nine_sections_in_order(script):
    text = (REPO / script).read_text()
    positions = [text.find(f"# {section}") for section in SECTIONS]
    assert -1 not in positions, [s for s, p in zip(SECTIONS, positions) if p == -1]
    assert positions == sorted(positions)


@pytest.mark.parametrize("script", CEILINGS)
def test_standalone_imports_only_installed_packages(script):
    tree = ast.parse((REPO / script).read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    local = {path.stem for path in REPO.glob("*.py")} | {p.name for p in REPO.iterdir() if p.is_dir()}
    assert not modules & local
    for module in modules:  # each resolves, and outside the repository
        spec = importlib.util.find_spec(module)
        origin = Path(spec.origin or "")
        assert REPO not in origin.parents or "site-packages" in origin.parts, module


@pytest.mark.parametrize("script, sibling, limit", SIBLINGS)
def test_siblings_differ_only_in_substance(script, sibling, limit):
    diff = subprocess.run(["diff", script, sibling], cwd=REPO, capture_output=True, text=True).stdout
    assert len(re.findall(r"^[<>]", diff, re.M)) <= limit  # as `diff a b | grep -c '^[<>]'` counts


# The skeleton's helpers: the same text in every script that holds them (toy_linear.py holds the first four). A fix
# to one goes into every script, in one change.
SHARED = ["list_checkpoints", "save_checkpoint", "resume_from_checkpoint", "as_one_line", "kill_workers",
          "handle_signals", "stop_run"]


def test_shared_helpers_are_the_same_text_in_every_script_that_holds_them():
    def functions(script):
        tree = ast.parse(text := (REPO / script).read_text())
        return {node.name: ast.get_source_segment(text, node) for node in tree.body if isinstance(node, ast.FunctionDef)}

    found = {script: functions(script) for script in CEILINGS}
    for name in SHARED:
        texts = {script: fns[name] for script, fns in found.items() if name in fns}
        holders = set(CEILINGS) - {"toy_linear.py"} if name in SHARED[4:] else set(CEILINGS)
        assert set(texts) == holders, name
        assert len(set(texts.values())) == 1, f"{name} differs between {sorted(texts)}"


def test_the_stop_on_a_signal_and_on_a_diverged_loss_is_one_text_in_every_diffusion_script():
    """The read of the loss with its divergence check, and the stop that every process agrees on before
    validation, are shared code: word for word in the four diffusion scripts (the helpers they call are checked
    above)."""
    def stop_code(script):
        text = (REPO / script).read_text()
        start = text.index("            save = global_step % args.checkpointing_steps == 0")
        return text[start:text.index("            # 8. Validation", start)]

    texts = {script: stop_code(script) for script in CEILINGS if script != "toy_linear.py"}
    assert len(set(texts.values())) == 1, sorted(texts)
    assert "stop_run(accelerator, args, " in texts["train_lora.py"]


def test_the_readme_test_command_is_the_one_ci_runs():
    command = ".venv/bin/python -m pytest -q tests"
    assert command in (REPO / "README.md").read_text()
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-1] == command
