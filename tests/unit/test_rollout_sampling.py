"""Sampling defaults, overrides and their validation messages."""
import pytest

from services.common.config import SamplingConfig
from services.common.errors import InvalidArgument
from services.rollout.sampling import NO_LOGPROBS, SamplingOverrides, resolve, sample_seed

DEFAULTS = SamplingConfig(temperature=0.7, top_p=0.9, top_k=50, max_tokens=16, logprobs=1, n=1)


def run(overrides=SamplingOverrides(), prompt_tokens=10, max_model_len=64, detokenize=False):
    return resolve(DEFAULTS, overrides, prompt_tokens=prompt_tokens, max_model_len=max_model_len, max_n=8, detokenize=detokenize)


def test_unset_fields_take_the_config_defaults():
    got = run()
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens, got.n, got.logprobs) == (0.7, 0.9, 50, 16, 1, 0)


def test_overrides_win_and_no_logprobs_turns_them_off():
    got = run(SamplingOverrides(temperature=0.0, top_k=-1, max_tokens=4, logprobs=NO_LOGPROBS, stop=("\n",)))
    assert (got.temperature, got.top_k, got.max_tokens, got.logprobs) == (0.0, -1, 4, None)
    assert got.detokenize, "stop strings need text"


def test_to_vllm_maps_top_k_off_and_streams_deltas():
    from vllm.sampling_params import RequestOutputKind

    params = run(SamplingOverrides(top_k=-1, seed=3)).to_vllm()
    assert params.top_k <= 0, "vLLM's 'off' for top-k"
    assert (params.seed, params.output_kind) == (3, RequestOutputKind.DELTA)


@pytest.mark.parametrize("overrides, kwargs, message", [
    (SamplingOverrides(temperature=-1.0), {}, r"temperature: must be in \[0.0, 100.0\], got -1.0"),
    (SamplingOverrides(top_p=0.0), {}, r"top_p: must be in \(0.0, 1.0\], got 0.0"),
    (SamplingOverrides(min_p=1.5), {}, r"min_p: must be in \[0.0, 1.0\], got 1.5"),
    (SamplingOverrides(top_k=-3), {}, r"top_k: must be -1 \(off\) or >= 1, got -3"),
    (SamplingOverrides(n=9), {}, r"n: must be in \[1, 8\], got 9"),
    (SamplingOverrides(n=2, temperature=0.0), {}, r"n: must be 1 with temperature 0"),
    (SamplingOverrides(logprobs=21), {}, r"logprobs: must be in \[0, 20\], got 21"),
    (SamplingOverrides(stop=tuple("abcdefghijklmnopq")), {}, r"stop: at most 16 stop strings, got 17"),
    (SamplingOverrides(), {"prompt_tokens": 0}, r"prompt: is empty"),
    (SamplingOverrides(), {"prompt_tokens": 64}, r"prompt: has 64 tokens; max_model_len is 64, so at most 63 fit"),
    (SamplingOverrides(max_tokens=60), {}, r"max_tokens: must be in \[1, 54\] \(max_model_len 64 - 10 prompt tokens\), got 60"),
])
def test_bad_values_name_the_field_and_the_limit(overrides, kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        run(overrides, **kwargs)


def test_sample_seeds_part_a_group_and_repeat_for_a_rerun():
    prompt = [5, 9, 2]
    group = [sample_seed(1234, prompt, i, version=3, done_tokens=0) for i in range(8)]
    assert len(set(group)) == 8, "a group's n samples need n different seeds"
    assert group == [sample_seed(1234, list(prompt), i, version=3, done_tokens=0) for i in range(8)], "a rerun repeats them"
    assert all(0 <= s < 2 ** 63 for s in group)
    # Any part of the identity changes the seed: the run's seed, the prompt, the version, a partial response.
    others = {sample_seed(1235, prompt, 0, 3, 0), sample_seed(1234, [5, 9, 3], 0, 3, 0),
              sample_seed(1234, prompt, 0, 4, 0), sample_seed(1234, prompt, 0, 3, 4)}
    assert group[0] not in others and len(others) == 4
