"""
Mutation testing of txlb's core modules (``python -m bench.mutation``), on cosmic-ray.

Coverage says a line ran; a mutant says whether a test would notice it going wrong.  Each
mutant is one small change cosmic-ray makes to one module (``<`` for ``<=``, ``and`` for
``or``, a number changed, ``not`` added, ...); the module's own unit test modules
(:data:`MODULE_TESTS`) then run against it, and the mutant is *killed* if they fail,
*timed out* if they run past ``--timeout`` (the mutant made something loop or wait), else it
*survived*.  A survivor is either a missing test or an equivalent mutant (no behaviour can
differ); those are listed with the reason in ``bench/results/mutation.md``.

Why cosmic-ray and not mutmut: mutmut 3 runs pytest only (it maps mutants to tests with its
own pytest plugin and rewrites the package into trampolines); cosmic-ray takes any test
command and a timeout, so each mutant runs twisted.trial on just the relevant modules.

Every mutant runs in a copy of the tree made for the run (one per ``--jobs``), never in the
working tree, so an interrupted run leaves no mutant behind.

Examples::

    python -m bench.mutation                       # every mutant of every core module
    python -m bench.mutation --module _cluster/health   # one module
    python -m bench.mutation --sample 50 --seed 1  # a fixed sample (what CI runs)
    python -m bench.mutation --changed origin/main # only modules a change touched
    python -m bench.mutation --known               # replay the known bugs (see KNOWN_BUGS)
    python -m bench.mutation --replay bench/results/mutation-full/_scheduling-router.json
                                                   # the survivors of a run, on today's code
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.mutation_known import EQUIVALENT, KNOWN_BUGS
from bench.mutation_targets import MODULE_TESTS

ROOT = Path(__file__).resolve().parent.parent

#: cosmic-ray's binary and comparison operators come as every (from, to) pair: ten
#: mutants per ``+``, most killed by any test that runs the line.  One meaningful
#: replacement per operator is kept (the classic "sufficient" set); the other operators
#: (numbers, ``not``, ``and``/``or``, booleans, exceptions, loops, decorators) all run.
_KEPT_PAIRS = {
    "ReplaceBinaryOperator": {"Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Mul",
                              "Mod_FloorDiv", "Pow_Mul", "BitOr_BitAnd", "BitAnd_BitOr",
                              "BitXor_BitOr", "LShift_RShift", "RShift_LShift"},
    "ReplaceComparisonOperator": {"Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Eq_NotEq",
                                  "NotEq_Eq", "Is_IsNot", "IsNot_Is", "In_NotIn",
                                  "NotIn_In", "Lt_Gt", "Gt_Lt"},
}


@dataclass
class Outcome:
    module: str
    operator: str
    occurrence: int
    line: int
    status: str  # killed, survived, timeout, incompetent, no-test
    diff: str = ""


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, status: str) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1

    def get(self, status: str) -> int:
        return self.counts.get(status, 0)


#: What a copy holds: the package, the plugin, the tests (with their fixtures), the docs,
#: which some tests hold the code to (test_failures reads docs/reliability.md's failure
#: table, test_resultlog and test_fields docs/result-log.md), and the benchmarks, which some
#: tests import (test_fields takes its varied summaries from bench.formats).
COPIED = ("txlb", "tests", "twisted", "docs", "bench")


def copy_tree(into: Path) -> Path:
    """A copy of what the tests need (:data:`COPIED`), so mutants touch no tree anyone
    works in."""
    for name in COPIED:
        # (not the benchmarks' own environments: bench/.venv-routers holds the Rust routers)
        shutil.copytree(ROOT / name, into / name,
                        ignore=shutil.ignore_patterns("__pycache__", "_trial_temp*", ".venv*"))
    return into


def test_command(copy: Path, tests: Sequence[str]) -> str:
    """
    Trial on ``tests``, run in ``copy`` (``env -C``) so the copy's txlb is imported.  It
    stops at the first failure (``--exitfirst``): one failing test kills a mutant, and the
    tests after it would only cost time.
    """
    return (f"env -C {copy} PYTHONPATH={copy} {sys.executable} -m twisted.trial --exitfirst "
            f"--temp-directory={copy}/_trial_temp " + " ".join(tests))


def baseline(copy: Path, modules: Iterable[str], timeout: float) -> bool:
    """
    Whether the modules' tests pass in ``copy`` with no mutant in it.  A test that fails
    there anyway (one reading a file the copy lacks) fails against every mutant too, and
    every mutant would be counted killed: no kill rate means anything until this passes.
    """
    tests = sorted({test for module in modules for test in MODULE_TESTS[module]})
    try:
        run = subprocess.run(test_command(copy, tests).split(), capture_output=True,
                             timeout=timeout * 10)
    except subprocess.TimeoutExpired:
        print(f"the tests, with no mutant, ran past {timeout * 10:g}s", flush=True)
        return False
    if run.returncode:
        tail = run.stdout.decode("utf-8", "replace").splitlines()[-40:]
        print("the tests fail with no mutant (so every mutant would count as killed):\n"
              + "\n".join(tail), flush=True)
        return False
    return True


def annotation_spans(module: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """
    Where the typing-only code is, as ((line, column), (end line, end column)): a mutant
    there is equivalent by construction.

    * every annotation: every core module has ``from __future__ import annotations``, so an
      annotation is never evaluated (``str | None`` to ``str & None``);
    * the body of a ``Protocol`` class: it declares a shape for the type checker, and no
      code calls it (removing a ``@property`` of one changes nothing that runs);
    * the test of ``if TYPE_CHECKING:``: ``if not TYPE_CHECKING:`` only runs those imports
      at run time too, and ``tests/unit/test_import_graph.py`` keeps every such import
      free of a circle, so the modules load the same.
    """
    tree = ast.parse((ROOT / "txlb" / f"{module}.py").read_text())
    spans = []

    def span(node: ast.AST, end: ast.AST | None = None) -> None:
        last = end if end is not None else node
        if getattr(last, "end_lineno", None) is not None:
            spans.append(((node.lineno, node.col_offset),  # type: ignore[attr-defined]
                          (last.end_lineno, last.end_col_offset or 0)))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        annotation = None
        if isinstance(node, ast.arg | ast.AnnAssign):
            annotation = node.annotation
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotation = node.returns
        elif isinstance(node, ast.ClassDef) and any(
                getattr(base, "id", getattr(base, "attr", None)) == "Protocol"
                for base in node.bases):
            first = node.body[0]
            decorators = getattr(first, "decorator_list", [])
            span(decorators[0] if decorators else first, node.body[-1])
        elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            span(node.test)
        if annotation is not None and annotation.end_lineno is not None:
            span(annotation)
    return spans


def mutants(module: str) -> list[object]:
    """
    cosmic-ray's work items for one module, less the redundant operator pairs and the
    mutants inside annotations (never evaluated).
    """
    from cosmic_ray.commands.init import _all_work_items  # type: ignore[import-untyped]

    spans = annotation_spans(module)
    kept = []
    for item in _all_work_items([ROOT / "txlb" / f"{module}.py"], {}):
        spec = item.mutations[0]
        name = spec.operator_name.split("/", 1)[-1]
        family, _, pair = name.partition("_")
        if family in _KEPT_PAIRS and pair not in _KEPT_PAIRS[family]:
            continue
        if any(start <= tuple(spec.start_pos) < end for start, end in spans):
            continue
        kept.append(item)
    return kept


#: Mutants of one module queued before its "who tests what" map is made (below that, the
#: map costs more than it saves).
SELECT_FROM = 6

#: Which tests ran each line of a module: line number -> trial test ids.
Coverage = dict[int, frozenset[str]]


def who_tests_what(module: str, copy: Path, timeout: float,
                   tests: Sequence[str] | None = None) -> Coverage:
    """
    Run the module's tests once under coverage with one context per test (coverage's
    ``dynamic_context = test_function``): for each line of ``module``, the tests that ran it.

    A mutant then first runs only the tests that reach its lines -- a few seconds instead of
    the whole list.  The context is the test method's qualified name (the class that
    defines it), which trial runs by name.  Lines reached only outside a test method (in
    ``setUp``, or by the reactor after the method returned) have no test here; the
    fallback in :func:`run_one` covers them.
    """
    from coverage import CoverageData

    data_file = copy / f".who-{module.replace('/', '-')}"
    rc = copy / ".who-rc"
    rc.write_text(f"[run]\ndynamic_context = test_function\n"
                  f"include = {copy}/txlb/{module}.py\ndata_file = {data_file}\n")
    # -u: a run measured as a whole (CI's COVERAGE_FILE, COVERAGE_PROCESS_START) must
    # neither take this run's data nor start a second measurement in it
    command = (f"env -C {copy} -u COVERAGE_FILE -u COVERAGE_PROCESS_START -u COVERAGE_RCFILE "
               f"PYTHONPATH={copy} {sys.executable} -m coverage run --rcfile={rc} "
               f"--data-file={data_file} -m twisted.trial --temp-directory={data_file}-trial "
               + " ".join(MODULE_TESTS[module] if tests is None else tests))
    try:
        subprocess.run(command.split(), capture_output=True, timeout=timeout * 10)
    except subprocess.TimeoutExpired:
        # no map, not no run: every mutant then meets the module's whole test list
        print(f"who tests what: {module}'s tests ran past {timeout * 10:g}s under coverage; "
              "its mutants run every test of the module", flush=True)
        return {}
    data = CoverageData(basename=str(data_file))
    data.read()
    wanted = str(copy / "txlb" / f"{module}.py")
    measured = [f for f in data.measured_files() if f == wanted]
    if not measured:
        return {}
    return {line: frozenset(c for c in contexts if c.startswith("tests."))
            for line, contexts in data.contexts_by_lineno(measured[0]).items()}


def tests_for(item: object, module: str, coverage: Coverage) -> tuple[str, ...]:
    """The tests that ran the mutated lines (all of the module's tests when none did)."""
    spec = item.mutations[0]  # type: ignore[attr-defined]
    found: set[str] = set()
    for line in range(spec.start_pos[0], spec.end_pos[0] + 1):
        found |= coverage.get(line, frozenset())
    return tuple(sorted(found)) or MODULE_TESTS[module]


def run_one(item: object, module: str, copy: Path, timeout: float,
            coverage: Coverage | None = None) -> Outcome:
    """
    Apply one mutant in ``copy`` and run tests against it.  With ``coverage``, the tests
    that reach the mutated lines run first; a mutant they kill is killed (a failing test
    is a failing test), and one that survives them is run against every test of the
    module before it counts as survived -- so selecting never turns a kill into a survivor.
    """
    from cosmic_ray.mutating import mutate_and_test  # type: ignore[import-untyped]
    from cosmic_ray.work_item import MutationSpec  # type: ignore[import-untyped]

    spec = item.mutations[0]  # type: ignore[attr-defined]
    local = MutationSpec(module_path=copy / "txlb" / f"{module}.py",
                         operator_name=spec.operator_name, occurrence=spec.occurrence,
                         start_pos=spec.start_pos, end_pos=spec.end_pos,
                         operator_args=spec.operator_args,
                         definition_name=spec.definition_name)
    everything = MODULE_TESTS[module]
    first = everything if coverage is None else tests_for(item, module, coverage)
    result = mutate_and_test([local], test_command(copy, first), timeout)
    status = _status(result)
    if status == "survived" and first != everything:
        result = mutate_and_test([local], test_command(copy, everything), timeout)
        status = _status(result)
    operator = spec.operator_name.split("/", 1)[-1]
    if status == "survived" and is_equivalent(module, operator, result.diff or ""):
        status = "equivalent"
    return Outcome(module, operator, spec.occurrence, spec.start_pos[0], status,
                   result.diff or "")


def _status(result: object) -> str:
    status = str(result.worker_outcome.value)  # type: ignore[attr-defined]
    if result.test_outcome is not None and status == "normal":  # type: ignore[attr-defined]
        status = str(result.test_outcome.value)  # type: ignore[attr-defined]
        if status == "killed" and result.output == "timeout":  # type: ignore[attr-defined]
            status = "timeout"
    return status


def is_equivalent(module: str, operator: str, diff: str) -> bool:
    """Whether the mutant whose ``diff`` this is, is one of :data:`EQUIVALENT`."""
    added = [line[1:] for line in diff.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return any(module == m and operator == o and any(snippet in line for line in added)
               for m, o, snippet, _ in EQUIVALENT)


def changed_modules(base: str) -> list[str]:
    """Core modules a change since ``base`` touched (``git diff --name-only``)."""
    names = subprocess.run(["git", "diff", "--name-only", base, "--", "txlb"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    return [m for m in MODULE_TESTS if f"txlb/{m}.py" in names]


def run_mutants(modules: Iterable[str], sample: int | None, seed: int, timeout: float,
                jobs: int, out: Path | None, fail_under: float, select: bool = True) -> int:
    work: list[tuple[str, object]] = []
    for module in modules:
        items = mutants(module)
        if sample is not None:
            items = random.Random(f"{seed}:{module}").sample(items, min(sample, len(items)))
        work += [(module, item) for item in items]
    print(f"{len(work)} mutants over {', '.join(modules)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="txlb-mutation-") as scratch:
        copies = [copy_tree(Path(scratch) / f"copy{n}") for n in range(jobs)]
        if not baseline(copies[0], sorted({module for module, _ in work}), timeout):
            return 1
        free = list(copies)
        coverage: dict[str, Coverage] = {}
        if select:
            # mapping a module costs one run of its tests under coverage: worth it only
            # when more mutants than that will use it (not for CI's few per module)
            queued = Counter(module for module, _ in work)
            wanted = sorted(module for module, count in queued.items() if count >= SELECT_FROM)
            with ThreadPoolExecutor(jobs) as pool:
                found = pool.map(lambda m: who_tests_what(m[1], copies[m[0] % jobs], timeout),
                                 enumerate(wanted))
                coverage = dict(zip(wanted, found, strict=True))
            print(f"who tests what: {sum(len(c) for c in coverage.values())} lines mapped",
                  flush=True)

        def task(entry: tuple[str, object]) -> Outcome:
            copy = free.pop()
            try:
                return run_one(entry[1], entry[0], copy, timeout, coverage.get(entry[0]))
            finally:
                free.append(copy)

        outcomes: list[Outcome] = []
        started = time.monotonic()
        with ThreadPoolExecutor(jobs) as pool:
            for n, outcome in enumerate(pool.map(task, work), 1):
                outcomes.append(outcome)
                if outcome.status not in ("killed", "timeout"):
                    print(f"  {outcome.status}: {outcome.module}:{outcome.line} "
                          f"{outcome.operator}#{outcome.occurrence}", flush=True)
                if n % 25 == 0:
                    print(f"  ... {n}/{len(work)} in {time.monotonic() - started:.0f}s",
                          flush=True)
    report(outcomes)
    for outcome in outcomes:
        if outcome.status == "survived":
            print(f"survived {outcome.module}:{outcome.line} {outcome.operator}"
                  f"#{outcome.occurrence}\n{outcome.diff}")
    if out is not None:
        out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    dead = sum(o.status in ("killed", "timeout") for o in outcomes)
    survived = sum(o.status == "survived" for o in outcomes)
    rate = 100.0 * dead / ((dead + survived) or 1)
    if rate < fail_under:
        print(f"kill rate {rate:.0f}% is under --fail-under {fail_under:g}%")
        return 1
    return 0


def table(outcomes: Sequence[Outcome]) -> list[str]:
    """The per-module Markdown table: killed, timed out, survived, equivalent, kill rate."""
    tallies: dict[str, Tally] = {}
    for outcome in outcomes:
        tallies.setdefault(outcome.module, Tally()).add(outcome.status)
    rows = ["| module | mutants | killed | timed out | survived | equivalent | other | "
            "killed of non-equivalent |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for module, tally in tallies.items():
        total = sum(tally.counts.values())
        dead = tally.get("killed") + tally.get("timeout")
        other = total - dead - tally.get("survived") - tally.get("equivalent")
        rate = dead / ((dead + tally.get("survived")) or 1)
        rows.append(f"| {module} | {total} | {tally.get('killed')} | {tally.get('timeout')} | "
                    f"{tally.get('survived')} | {tally.get('equivalent')} | {other} | "
                    f"{rate:.0%} |")
    return rows


def report(outcomes: Sequence[Outcome]) -> None:
    print("\n".join(table(outcomes)))


def run_known(timeout: float) -> int:
    """Apply each known bug to a fresh copy; the tests must fail with it (and pass without)."""
    failures = 0
    with tempfile.TemporaryDirectory(prefix="txlb-known-") as scratch:
        copy = copy_tree(Path(scratch) / "copy")
        clean = subprocess.run(test_command(copy, ("tests.unit.test_regressions",)).split(),
                               capture_output=True, timeout=timeout)
        print(f"{'passes' if clean.returncode == 0 else 'FAILS'} without any bug")
        failures += clean.returncode != 0
        for bug in KNOWN_BUGS:
            path = copy / bug.path
            original = path.read_text()
            if original.count(bug.old) != 1:
                print(f"DOES NOT APPLY (code changed): {bug.name}")
                failures += 1
                continue
            path.write_text(original.replace(bug.old, bug.new))
            try:
                run = subprocess.run(test_command(copy, bug.tests).split(),
                                     capture_output=True, timeout=timeout)
                caught = run.returncode != 0
            except subprocess.TimeoutExpired:
                caught = True
            finally:
                path.write_text(original)
            print(f"{'killed  ' if caught else 'SURVIVED'} {bug.name}")
            failures += not caught
    return 1 if failures else 0


class StaleMutant(ValueError):
    """A recorded mutant whose lines are no longer in the module as it is (the code moved on)."""


def apply_diff(source: str, diff: str) -> str:
    """
    ``source`` with one recorded mutant's ``diff`` applied: the hunk's context and removed
    lines, found exactly once, replaced by its context and added lines.

    cosmic-ray names a mutant by its operator and occurrence index, which shift whenever the
    module changes; the diff names the change itself, so a survivor recorded by an earlier
    run can be tried again on today's code as long as its lines are still there.
    """
    before: list[str] = []
    after: list[str] = []
    in_hunk = False
    for line in diff.splitlines():
        if line.startswith("@@"):
            if in_hunk:
                raise StaleMutant("a recorded mutant has one hunk; this diff has several")
            in_hunk = True
            continue
        if not in_hunk:
            continue
        if line.startswith("-"):
            before.append(line[1:])
        elif line.startswith("+"):
            after.append(line[1:])
        else:
            text = line[1:] if line.startswith(" ") else line
            before.append(text)
            after.append(text)
    if not in_hunk or before == after:
        raise StaleMutant("the diff changes nothing")
    old, new = "\n".join(before) + "\n", "\n".join(after) + "\n"
    found = source.count(old)
    while not found and before[-1:] == after[-1:] == [""]:
        # at the end of the module cosmic-ray's diff ends on a blank context line the
        # file does not have (its last line's newline is the file's end)
        before, after = before[:-1], after[:-1]
        old, new = "\n".join(before) + "\n", "\n".join(after) + "\n"
        found = source.count(old)
    if found != 1:
        raise StaleMutant(f"its lines occur {found} times in the module now, not once")
    return source.replace(old, new)


def replay(recorded: Path, timeout: float, jobs: int, out: Path | None,
           modules: Sequence[str] | None = None) -> int:
    """
    Run the survivors recorded in ``recorded`` (a ``--json`` output) again, each applied
    by its diff (:func:`apply_diff`) to a copy of today's tree, against every test of its
    module.  A mutant whose lines have gone is reported ``stale``; one that survives and
    matches :data:`EQUIVALENT` now is ``equivalent``.
    """
    entries = [o for o in json.loads(recorded.read_text())
               if o["status"] == "survived" and (not modules or o["module"] in modules)]
    print(f"{len(entries)} recorded survivors from {recorded}", flush=True)
    with tempfile.TemporaryDirectory(prefix="txlb-replay-") as scratch:
        free = [copy_tree(Path(scratch) / f"copy{n}") for n in range(jobs)]
        if entries and not baseline(free[0], sorted({str(e["module"]) for e in entries}),
                                    timeout):
            return 1

        def task(entry: dict[str, object]) -> Outcome:
            module, diff = str(entry["module"]), str(entry["diff"])
            outcome = Outcome(module, str(entry["operator"]), int(str(entry["occurrence"])),
                              int(str(entry["line"])), "stale", diff)
            copy = free.pop()
            path = copy / "txlb" / f"{module}.py"
            original = path.read_text()
            try:
                path.write_text(apply_diff(original, diff))
            except StaleMutant as why:
                print(f"  stale: {module}:{outcome.line} {outcome.operator}: {why}",
                      flush=True)
                free.append(copy)
                return outcome
            try:
                run = subprocess.run(test_command(copy, MODULE_TESTS[module]).split(),
                                     capture_output=True, timeout=timeout)
                outcome.status = "killed" if run.returncode else "survived"
            except subprocess.TimeoutExpired:
                outcome.status = "timeout"
            finally:
                path.write_text(original)
                free.append(copy)
            if outcome.status == "survived" and is_equivalent(module, outcome.operator, diff):
                outcome.status = "equivalent"
            return outcome

        with ThreadPoolExecutor(jobs) as pool:
            outcomes = list(pool.map(task, entries))
    report(outcomes)
    for outcome in outcomes:
        if outcome.status == "survived":
            print(f"survived {outcome.module}:{outcome.line} {outcome.operator}\n"
                  f"{outcome.diff}")
    if out is not None:
        out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 1 if any(o.status == "survived" for o in outcomes) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(MODULE_TESTS),
                        help="only this core module (repeat for several)")
    parser.add_argument("--changed", metavar="REV",
                        help="only the core modules changed since REV")
    parser.add_argument("--sample", type=int, help="at most this many mutants per module")
    parser.add_argument("--seed", type=int, default=1, help="for --sample (default 1)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one mutant's tests may take (default 60)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--fail-under", type=float, default=100.0, metavar="PCT",
                        help="exit 1 when under PCT%% of the non-equivalent mutants are "
                             "killed (default 100)")
    parser.add_argument("--known", action="store_true", help="replay KNOWN_BUGS only")
    parser.add_argument("--no-select", action="store_true",
                        help="run every test of the module against each mutant (slower; by "
                             "default the tests that reach the mutated lines run first)")
    parser.add_argument("--replay", type=Path, metavar="JSON",
                        help="the survivors in this --json output, applied by their diffs "
                             "to today's code (exit 1 if any still survives)")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay, args.timeout, max(1, args.jobs), args.json, args.module)
    if args.known:
        return run_known(args.timeout)
    modules = args.module or list(MODULE_TESTS)
    if args.changed:
        modules = [m for m in modules if m in changed_modules(args.changed)]
        if not modules:
            print("no core module changed")
            return 0
    return run_mutants(modules, args.sample, args.seed, args.timeout, max(1, args.jobs),
                       args.json, args.fail_under, select=not args.no_select)


if __name__ == "__main__":
    raise SystemExit(main())
