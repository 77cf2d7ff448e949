"""lm-evaluation-harness's native ``srm-max`` model: requests run through the engine
in batches, without a server.

    pip install 'srm-max[eval]'
    python -m srm_max.lm_eval_model --model srm-max --model_args pretrained=DIR --tasks lambada_openai
    python -m srm_max.lm_eval_model --model srm-max --model_args pretrained=DIR,max_length=256,batch_size=32 ...

The wrapper is lm-eval's own command line (every option of ``lm_eval run``) with
this model registered: lm-eval (0.4.13) finds models only in its own registry,
not through entry points. In Python, ``import srm_max.lm_eval_model`` registers
it for ``lm_eval.simple_evaluate(model="srm-max", model_args=...)``.

``model_args``: ``pretrained`` (a checkpoint directory; default the embedded
model), ``device``, ``dtype``, ``max_length`` (tokens the model reads per request;
default its context length), ``batch_size`` (prompts per ``generate`` batch;
loglikelihood batches are the engine's), ``max_gen_toks`` (default 256),
``seed`` (for sampled generate_until requests).

- ``loglikelihood``: ``Generator.loglikelihood`` (lm-eval's tokenization; a shared
  context is read once and its state forked);
- ``loglikelihood_rolling``: lm-eval's rolling windows (``serve/logprobs.py``);
- ``generate_until``: ``Generator.generate`` per batch of requests with the same
  generation arguments, stopping at the ``until`` strings and at ``<|endoftext|>``,
  the context truncated on the left to leave room for ``max_gen_toks`` (as lm-eval's
  ``hf`` model).
"""

from __future__ import annotations

import json
import sys

import lm_eval.models  # noqa: F401  lm-eval fills its registry with its own models only while it is empty
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from .errors import GenerationError
from .progress import Progress
from .serve.generator import Generator
from .serve.logprobs import check_max_length


@register_model("srm-max")
class SRMMaxLM(TemplateLM):
    """An srm-max checkpoint as an lm-eval model (module docs)."""

    def __init__(self, pretrained: str | None = None, device: str = "auto", dtype: str | None = None,
                 max_length: int | None = None, batch_size: int | str = 64, max_gen_toks: int = 256,
                 seed: int = 1234, generator: Generator | None = None, **kwargs):
        """``generator``: a loaded Generator instead of ``pretrained`` (from Python only)."""
        super().__init__()
        self.generator = generator or Generator.from_pretrained(pretrained, device=device, dtype=dtype)
        if self.generator.tokenizer is None:
            raise GenerationError(f"{pretrained}: lm-eval needs the checkpoint's tokenizer.json")
        self._max_length = check_max_length(None if max_length is None else int(max_length), self.generator.config)
        # lm-eval's "auto" means "find the largest that fits": the engine batches by its own budget
        self.batch_size = 64 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)

    # -- what TemplateLM asks for
    @property
    def eot_token_id(self) -> int:
        eot = self.generator.end_of_text_id
        if eot is None:
            raise GenerationError("this tokenizer has no <|endoftext|>: lm-eval reads it before an empty context")
        return eot

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.generator.encode(string) if string else []

    def tok_decode(self, tokens) -> str:
        return self.generator.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        with Progress(total=len(requests), desc="loglikelihood", enabled=not disable_tqdm, delay=1.0) as bar:
            results = self.generator.loglikelihood([(ctx, cont) for _, ctx, cont in requests], self.max_length,
                                                   progress=lambda done, total: bar.update_to(done))
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        strings = [req.args[0] for req in requests]
        scored = [i for i, s in enumerate(strings) if self.tok_encode(s)]
        totals = [0.0] * len(strings)  # a text of no tokens has log-likelihood 0 (lm-eval: no windows)
        if scored:
            for i, total in zip(scored, self.generator.loglikelihood_rolling([strings[i] for i in scored],
                                                                              self.max_length)):
                totals[i] = total
        for s, total in zip(strings, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (s,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}  # requests with the same generation arguments run together
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        with Progress(total=len(requests), desc="generate_until", enabled=not disable_tqdm, delay=1.0) as bar:
            for members in groups.values():
                options = self._generation_options(requests[members[0]].args[1])
                budget = options.pop("budget")
                for start in range(0, len(members), self.batch_size):
                    batch = members[start:start + self.batch_size]
                    prompts = [self._prompt(requests[i].args[0], budget) for i in batch]
                    for i, c in zip(batch, self.generator.generate(prompts, **options)):
                        out[i] = c.text
                        self.cache_hook.add_partial("generate_until", requests[i].args, c.text)
                    bar.update(len(batch))
        return out

    def _generation_options(self, gen_kwargs: dict) -> dict:
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        do_sample = kwargs.pop("do_sample", False)
        temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
        options = dict(max_new_tokens=max_new, temperature=temperature, stop=[s for s in until if s],
                       seed=int(kwargs.pop("seed", self.seed)))
        if temperature > 0:
            options |= dict(top_p=float(kwargs.pop("top_p", 1.0)), top_k=int(kwargs.pop("top_k", 0) or 0))
        eot = self.generator.end_of_text_id
        if eot is not None:
            options["stop"].append(eot)
        # the context keeps room for the new tokens (lm-eval's hf model: max_length - max_gen_toks)
        options["budget"] = max(1, self.max_length - max_new)
        return options

    def _prompt(self, context: str, budget: int) -> list[int]:
        ids = self.tok_encode(context)[-budget:]
        return ids or [self.eot_token_id]


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line (``lm_eval run ...``) with the srm-max model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    # later imports of srm_max.lm_eval_model get this module, not a second registration
    sys.modules.setdefault("srm_max.lm_eval_model", sys.modules[__name__])
    main()
