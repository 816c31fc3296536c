"""The verifier pool: parallel workers, per-verifier deadlines, hung workers killed and replaced."""
import threading

import pytest

from services.reward.pool import InProcessRunner, VerifierOutcome, VerifierPool, VerifyTask

# sympy expands and simplifies this for minutes; antlr backtracks exponentially on deep nesting.
SLOW_SYMPY = r"\boxed{(x+1)^{10000}-1}"
SLOW_PARSE = "\\boxed{" + "{" * 30 + "1" + "}" * 30 + "}"
RIGHT = VerifyTask(r"so \boxed{\frac12}", "0.5", ("acc", "math_17k_acc"))


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(parallel=2, timeout_s=1.5) as pool:
        yield pool


def test_pool_matches_in_process_scores(pool):
    tasks = [RIGHT, VerifyTask(r"\boxed{3}", "4", ("acc", "format", "step")), VerifyTask("", "1", ("acc",))]
    assert pool.run(tasks) == InProcessRunner().run(tasks)
    assert pool.run(tasks)[0] == [VerifierOutcome(1.0), VerifierOutcome(1.0)]


def test_a_hung_verifier_gets_its_timeout_score_and_the_pool_keeps_serving(pool):
    replaced = pool.replaced
    slow, fast, nested = pool.run([
        VerifyTask(SLOW_SYMPY, "2", ("format", "acc", "math_verify")),
        RIGHT,
        VerifyTask(SLOW_PARSE, "1", ("acc",)),
    ])
    # format finished before acc hung; acc timed out (-0.5); math_verify hung on a fresh worker too.
    assert slow == [VerifierOutcome(0.0), VerifierOutcome(-0.5, True), VerifierOutcome(0.0, True)]
    assert fast == [VerifierOutcome(1.0), VerifierOutcome(1.0)]
    assert nested == [VerifierOutcome(-0.5, True)]
    assert pool.replaced == replaced + 3
    # the replacements score at once, on both workers
    assert pool.run([RIGHT] * 4) == [[VerifierOutcome(1.0), VerifierOutcome(1.0)]] * 4


def test_verifiers_after_a_hung_one_still_run(pool):
    formatted = "<think>Step 1: a</think> <answer>" + SLOW_SYMPY + "</answer>"
    bare, tagged = pool.run([VerifyTask(SLOW_SYMPY, "2", ("acc", "format", "step")),
                             VerifyTask(formatted, "2", ("acc", "format", "step"))])
    assert bare == [VerifierOutcome(-0.5, True), VerifierOutcome(0.0), VerifierOutcome(0.0)]
    assert tagged == [VerifierOutcome(-0.5, True), VerifierOutcome(1.0), VerifierOutcome(1 / 3)]


def test_concurrent_callers_share_the_workers(pool):
    results = {}

    def call(key):
        results[key] = pool.run([RIGHT, VerifyTask(r"\boxed{7}", "8", ("acc",))] * 3)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = [[VerifierOutcome(1.0), VerifierOutcome(1.0)], [VerifierOutcome(-0.5)]] * 3
    assert results == {k: expected for k in range(4)}


def test_close_kills_every_worker_and_refuses_work():
    pool = VerifierPool(parallel=2, timeout_s=1.0)
    processes = [w.process for w in pool._all]
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    pool.close()
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([RIGHT])
