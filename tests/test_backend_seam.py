"""A backend the package does not know (tests/toy_backend.py: no KV cache, every forward recomputed) runs
every method through the engine, the benchmark and the server: the seam is `specexec.backends.base`."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch
from server_helpers import byte_tokenizer, live_server
from tiny_models import PERTURB_NOISE, hf_greedy, perturbed, tiny_model
from toy_backend import ToyModel

import specexec
from specexec.bench import make_configs, run_benchmark
from specexec.budget.costs import CostModel
from specexec.prompts import Prompt
from specexec.server import create_app

PROMPT = [5, 17, 42, 8, 99, 3, 61, 7]
NEW_TOKENS = 20
# A target pass that costs about the same for one token as for many, and a cheap draft: the auto budget
# then builds trees, as on an offloaded target.
CHEAP_VERIFICATION = CostModel({1: 1.0, 64: 1.05, 1024: 1.5}, {1: 0.01, 128: 0.03})
ENGINE_CASES = [
    ("ar", {}),
    ("sd", {"budget": 4}),
    ("sd", {"budget": 3, "lookahead_schedule": "heuristic"}),
    ("dsl", {"budget": 6}),
    ("dsl", {"budget": "auto"}),
    ("specinfer", {"budget": 8}),
    ("specexec", {"budget": 16}),
    ("specexec", {"budget": "auto"}),
    ("specexec", {"budget": 12, "ngram": 3}),
]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def pair(tok):
    target = tiny_model("qwen2", seed=3, vocab_size=len(tok))
    return ToyModel(target), ToyModel(perturbed(target, PERTURB_NOISE["qwen2"]))


def test_every_method_covers_the_registry() -> None:
    assert {method for method, _ in ENGINE_CASES} == set(specexec.METHODS)


@pytest.mark.parametrize(("method", "options"), ENGINE_CASES)
def test_every_method_is_exact_through_the_engine(pair, method: str, options: dict) -> None:
    target, draft = pair
    reference = hf_greedy(target.module, PROMPT, NEW_TOKENS)
    before = draft.forwards
    out = specexec.generate(
        target,
        draft,
        PROMPT,
        method=method,
        max_new_tokens=NEW_TOKENS,
        cost_model=CHEAP_VERIFICATION,
        **options,
    )
    assert out.tokens == reference  # the Hugging Face model's own greedy output
    if method != "ar":
        assert draft.forwards > before and sum(out.stats.accepted) > 0  # it did draft, and drafts landed


@pytest.mark.parametrize("method", list(specexec.METHODS))
def test_sampling_runs_and_is_reproducible(pair, method: str) -> None:
    target, draft = pair
    options = {"method": method, "max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    budget = {"dsl": 6, "specexec": 16}.get(method)
    options |= {"budget": budget} if budget else {}
    first = specexec.generate(target, draft, PROMPT, **options)
    assert len(first.tokens) == 12
    assert specexec.generate(target, draft, PROMPT, **options).tokens == first.tokens


def test_the_benchmark_runs_every_method_on_it(pair) -> None:
    target, draft = pair
    configs = make_configs(
        list(specexec.METHODS), budgets=[8], sd_budgets=[3], specinfer_budgets=[8], dsl_budgets=[4]
    )
    prompts = [Prompt("a", "", PROMPT), Prompt("b", "", PROMPT[::-1])]
    result = run_benchmark(
        target, draft, None, prompts, configs, max_new_tokens=12, warmup_tokens=4, progress=False
    )
    assert {r["method"] for r in result.records} == set(specexec.METHODS)
    for prompt in prompts:
        outputs = {r["method"]: r["tokens"] for r in result.records if r["prompt_id"] == prompt.id}
        assert outputs["ar"] == hf_greedy(target.module, prompt.input_ids, 12)
        assert all(tokens == outputs["ar"] for tokens in outputs.values()), outputs


@pytest.mark.parametrize(
    ("method", "budget"), [("ar", None), ("sd", 4), ("dsl", 6), ("specinfer", 8), ("specexec", 16)]
)
def test_the_server_serves_every_method_from_it(pair, tok, method: str, budget: int | None) -> None:
    target, draft = pair
    prompt = "The quick brown fox"
    ids = tok(prompt)["input_ids"]
    expected = tok.decode(hf_greedy(target.module, ids, 16))
    app = create_app(target, draft, tok, method=method, budget=budget, model_name="toy", eos_token_id=[])
    with live_server(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        body = {"model": "toy", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        assert http.get("/health").status_code == 200  # its probe runs a forward through the engine


def test_the_toy_runner_is_not_the_torch_runner(pair) -> None:
    """Test design: the toy backend really is a third implementation of the runner contract."""
    from specexec.backends import make_runner
    from specexec.backends.torch.runner import ModelRunner

    runner = make_runner(pair[0], 16)
    assert not isinstance(runner, ModelRunner) and type(runner).__module__ == "toy_backend"
    logits = runner.extend(torch.tensor(PROMPT), logits_to_keep=0)
    with torch.no_grad():
        reference = pair[0].module(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def _runtimes() -> dict[str, object]:
    import toy_backend

    from specexec.backends import backend

    runtimes = {"torch": backend("torch"), "toy": toy_backend}
    if backend("llamacpp").unavailable() is None:
        runtimes["llamacpp"] = backend("llamacpp")
    return runtimes


@pytest.mark.parametrize("name", ["torch", "llamacpp", "toy"])
def test_each_runtime_is_a_runtime(name: str) -> None:
    """Both runtimes and the toy expose what `base.Runtime` says, with its functions' parameters; the
    ones that take --ram are `StreamingRuntime`s."""
    import inspect

    from specexec.backends.base import Runtime, StreamingRuntime
    from specexec.backends.options import LoadOptions

    runtimes = _runtimes()
    if name not in runtimes:
        pytest.skip("the llama.cpp backend needs specexec[llamacpp]")
    runtime = runtimes[name]
    assert isinstance(runtime, Runtime)
    for method in ("unavailable", "refusal", "load", "default_draft_vocab", "default_draft_quant"):
        wanted = list(inspect.signature(getattr(Runtime, method)).parameters)[1:]  # less `self`
        assert list(inspect.signature(getattr(runtime, method)).parameters) == wanted, (name, method)
    keys = {option.name for option in dataclasses.fields(LoadOptions)} | {"gguf_quant"}  # `LoadOptions.given`
    assert set(runtime.OPTIONS) <= keys
    assert isinstance(runtime, StreamingRuntime) == ("ram" in runtime.OPTIONS)


def test_a_module_without_the_runtime_face_is_not_a_runtime() -> None:
    import types

    from specexec.backends.base import Runtime

    assert not isinstance(types.ModuleType("empty"), Runtime)
