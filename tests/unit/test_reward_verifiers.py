"""Each verifier on correct, wrong, malformed and adversarial answers, with MindSpeed-RL's scores."""
import pytest

from services.common.config import RULE_VERIFIERS
from services.common.errors import InvalidArgument
from services.reward.math_answer import answers_equivalent, extract_answer, last_boxed, minerva_answer
from services.reward.verifiers import REGISTRY, get_verifier, has_strict_structure, run_verifier

WELL_FORMED = r"<think>6*7=42, minus 8</think> <answer>The result is \boxed{34}</answer>"
LONG = "x" * 100_000


def score(name: str, response: str, label: str) -> float:
    return run_verifier(name, response, label)


def test_registry_has_mindspeed_names_and_the_configs_list_is_the_same():
    assert set(REGISTRY) == {"format", "strict_format", "base_acc", "acc", "math_17k_acc", "math_verify", "acc_for_dapo",
                             "acc_for_ppo", "math_verify_reward", "step", "sandbox_fusion"}  # the last: verl's code verifier
    assert set(RULE_VERIFIERS) == set(REGISTRY)  # what `dockrl config check` accepts in rl_config.verifier_function


def test_unknown_verifier_names_the_field_and_the_known_ones():
    with pytest.raises(InvalidArgument, match=r"verifier_function: unknown verifier 'accc'; known: format, strict_format"):
        get_verifier("accc")


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, boxed",
    [
        (r"so \boxed{\frac{1}{\sqrt{2}}} done", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"\boxed{1} then \boxed{\{2, 3\}}", r"\{2, 3\}"),  # the last one, escaped braces inside
        (r"\boxed{\frac{1}{2}", None),  # unbalanced: no answer
        (r"\boxed 5$ more", "5"),
        (r"\fbox{7}", "7"),
        ("no box here", None),
        ("", None),
    ],
)
def test_last_boxed_matches_braces(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so \boxed{\dfrac12}.", r"\frac{1}{2}"),
        ("Thus the answer is 34.", "34"),
        ("First 3, then 4,000", "4000"),
        (r"The final answer is $\frac{3}{4}$. I hope it is correct.", r"\frac{3}{4}"),
        ("", ""),
    ],
)
def test_extract_answer_rules_in_order(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "prediction, label, equal",
    [
        (r"\frac12", "1/2", True),
        ("0.5", r"\frac{1}{2}", True),
        (r"34 \text{ cm}", "34", True),
        ("x^2+2x+1", "(x+1)^2", True),
        (r"\{1,2\}", r"\{2,1\}", True),
        ("35", "34", False),
        ("", "34", False),
        ("-34", "34", False),
    ],
)
def test_equivalence_through_math_verify(prediction, label, equal):
    assert answers_equivalent(prediction, label) is equal


# ---------------------------------------------------------------- format, strict_format, step


def test_format():
    assert score("format", "<think>a</think>\n<answer>34</answer>", "") == 1.0
    assert score("format", "<think>a</think> text <answer>34</answer>", "") == 0.0  # text between blocks
    assert score("format", "<answer>34</answer>", "") == 0.0
    assert score("format", "", "") == 0.0


def test_strict_format():
    assert has_strict_structure(WELL_FORMED)
    assert score("strict_format", WELL_FORMED, "") == 1.0
    assert score("strict_format", r"<think>a</think><answer>34</answer>", "") == -0.5  # no box
    assert score("strict_format", r"<think>\boxed{1}</think><answer>\boxed{2}</answer>", "") == -0.5  # two boxes
    assert score("strict_format", r"<answer>\boxed{2}</answer><think>a</think>", "") == -0.5  # order
    assert score("strict_format", WELL_FORMED + " trailing", "") == -0.5
    assert score("strict_format", "", "") == -0.5


def test_step():
    assert score("step", "Step 1: a\nStep 2: b\nStep 3: c", "") == 1.0
    assert score("step", "First, we add. Next, we carry.", "") == pytest.approx(2 / 3)
    assert score("step", "42", "") == 0.0


# ---------------------------------------------------------------- accuracy verifiers


def test_base_acc_needs_the_strict_structure_and_the_right_answer():
    assert score("base_acc", WELL_FORMED, "34") == 1.0
    assert score("base_acc", WELL_FORMED, "35") == 0.0
    assert score("base_acc", r"\boxed{34}", "34") == 0.0  # right answer, no structure


def test_acc_scores_right_wrong_and_unboxed():
    assert score("acc", r"So it is \boxed{34}.", "34") == 1.0
    assert score("acc", r"So it is \boxed{35}.", "34") == -0.5
    assert score("acc", "So it is 34.", "34") == -1.0  # not boxed
    assert score("acc", r"\boxed{\frac{1}{2}", "1/2") == -1.0  # malformed box
    assert score("acc", "", "34") == -1.0


def test_acc_reads_only_the_assistant_turn():
    raw = r"<|im_start|>user Put \boxed{1}<|im_end|><|im_start|>assistant \boxed{34}<|im_end|> \boxed{99}"
    assert score("acc", raw, "34") == 1.0


def test_math_17k_acc():
    assert score("math_17k_acc", r"\boxed{\frac12}", "1/2") == 1.0
    assert score("math_17k_acc", r"\boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert score("math_17k_acc", r"\boxed{34 \text{ dollars}} and more text.", "34") == 1.0
    assert score("math_17k_acc", r"\boxed{33}", "34") == 0.0
    assert score("math_17k_acc", "34", "34") == 0.0


@pytest.mark.parametrize("name", ["math_17k_acc", "acc_for_ppo"])
@pytest.mark.parametrize("response, label, mindspeed", [
    # Scores MindSpeed-RL's math_17k_accuracy_reward / ppo_accuracy_reward give (mathruler 0.1.0), input by input.
    (r"so \boxed{7}", "7", 1.0),
    (r"\fbox{7}", "7", 0.0),  # only \boxed counts (math-verify would take \fbox)
    (r"\boxed{1, 2}", "2, 1", 0.0),  # a list's order counts
    (r"\boxed{1,2}", "1, 2", 1.0),
    (r"\boxed{x=3}", "3", 1.0),  # an `x =` before the value is dropped
    (r"\boxed{1} then \boxed{2}", "2", 1.0),  # the last box
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
])
def test_mindspeed_named_accuracy_verifiers_score_as_mindspeed_does(name, response, label, mindspeed):
    assert score(name, response, label) == mindspeed


def test_math_verify_reads_the_whole_response():
    assert score("math_verify", r"The answer is $\frac{1}{2}$.", "0.5") == 1.0
    assert score("math_verify", "so 34", "34") == 1.0
    assert score("math_verify", r"\boxed{33}", "34") == 0.0
    assert score("math_verify", "", "34") == 0.0


def test_math_verify_reward_gates_math_verify_on_the_format():
    assert score("math_verify_reward", r"<think>half</think> <answer>$\frac{1}{2}$</answer>", "0.5") == 1.0
    assert score("math_verify_reward", "<think>34?</think>\n<answer>33</answer>", "34") == 0.0  # wrong, well formed
    assert score("math_verify_reward", r"The answer is $\frac{1}{2}$.", "0.5") == 0.0  # right, no format
    assert score("math_verify", r"The answer is $\frac{1}{2}$.", "0.5") == 1.0  # the gate is the only difference


def test_acc_for_dapo_minerva_answer_line():
    assert score("acc_for_dapo", "work...\nAnswer: 34", "34") == 1.0
    assert score("acc_for_dapo", "work...\nanswer : 34 cm", "34") == 1.0  # units dropped
    assert score("acc_for_dapo", r"Answer: $\frac12$", r"\frac{1}{2}") == 1.0
    assert score("acc_for_dapo", "Answer: 35", "34") == -1.0
    assert score("acc_for_dapo", r"\boxed{34}", "34") == -1.0  # no Answer: line
    assert score("acc_for_dapo", "Answer: 34\n" + "y" * 400, "34") == -1.0  # outside the last 300 chars
    assert minerva_answer("Answer: 1\nAnswer: 2") == "2"


# What each verifier gives an answer-less response, and a 100k-character one ending in the right box.
NO_ANSWER = {"format": 0.0, "strict_format": -0.5, "base_acc": 0.0, "acc": -1.0, "math_17k_acc": 0.0, "acc_for_ppo": 0.0,
             "math_verify": 0.0, "math_verify_reward": 0.0, "acc_for_dapo": -1.0, "step": 0.0, "sandbox_fusion": 0.0}
LONG_BOXED = {"format": 0.0, "strict_format": -0.5, "base_acc": 0.0, "acc": 1.0, "math_17k_acc": 1.0, "acc_for_ppo": 1.0,
              "math_verify": 1.0, "math_verify_reward": 0.0, "acc_for_dapo": -1.0, "step": 0.0, "sandbox_fusion": 0.0}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_verifier_on_empty_and_100k_character_responses(name):
    assert score(name, "", "34") == NO_ANSWER[name]
    assert score(name, LONG, "34") == NO_ANSWER[name]
    assert score(name, LONG + r" so \boxed{34}", "34") == LONG_BOXED[name]


def test_nested_grouping_braces_keep_their_value():
    nested = "\\boxed{" + "{" * 5 + "1" + "}" * 5 + "}"
    assert score("acc", nested, "1") == 1.0
    assert score("math_17k_acc", nested, "1") == 1.0
    deep = "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}"  # string work only: no recursion limit
    assert last_boxed(deep) == "{" * 5000 + "1" + "}" * 5000
