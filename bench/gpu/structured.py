"""Structured outputs on the GPU: what grammar-constrained decoding costs at batch
64, whether tool calls forced by `tool_choice: required` all parse, and whether
the default model's bf16 greedy outputs equal its float32 ones.

Sections:
- `constrained` (the engine API; llama3-8b, bf16, dummy weights): 64 prompts at
  once, each with a JSON schema of its own (nested objects, enums, arrays, bounded
  strings and integers, so that every answer ends within its token budget whatever
  the weights), run once to compile the schemas, then timed; then the same prompts
  unconstrained, each decoding as many tokens as its constrained answer did
  (`ignore_eos`), so both runs decode the same tokens at the same batch. Output tok/s
  of each and their ratio; every constrained answer parsed and validated against its
  schema (`jsonschema`) and ended by its grammar; the host time of the masks a step
  (llguidance filling a step's rows, while the device runs the step) and its share of
  the timed run's wall time; in both runs, the ms a step the engine's thread spends
  launching, catching grammars up, waiting for masks and completing (`MaskClock`).
- `tools` (a mesh of one worker, the chat API over HTTP): 64 requests at once with two
  tools and `tool_choice: required`, half of them allowing parallel calls: every
  call names one of the tools and its arguments parse and validate against its
  parameters.
- `default_dtypes` (pydoc-llama, the trained default model): 16 prompts, greedy, bf16
  against float32: how many outputs are equal, and for each that is not, where it
  parts and the gap there between the two tokens' float32 logprobs (a near-tie by
  bench/gpu/engine_checks.py's rule when within 1e-2); beside it, transformers' bf16
  and float32 answers to the same prompts on the same device
  (bench/gpu/default_dtypes.py).

Usage: python -m bench.gpu.structured --out bench/results/structured.json [--skip ...]
           [--device cpu] [--profile] [--switch-interval SECONDS]
`--profile`: the constrained section also runs both again under torch.profiler
(bench/gpu/step_profile.py): the device's kernel time a step against the wall's, and
the host's costliest operators and CUDA calls a step in each. `--switch-interval`:
the interpreter's (sys.setswitchinterval: how long a thread asking for the GIL waits
for the running one to give it up; 0.005 by default), to see what the engine's thread
loses to the mask thread.
The dry run (`--device cpu`): tiny-llama in float32, 4 prompts, short answers; the
dtypes section in bf16 and float32 on the CPU, 2 prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time

from bench.gpu import ceilings
from bench.gpu import default_dtypes as dtypes
from bench.gpu.engine_rates import random_prompts, sync
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from bench.gpu.step_profile import MaskClock, print_compared, profiled
from engine import LLM, SamplingParams, StructuredOutput
from yinian.default_model import ensure_default_model
from yinian.mesh import Mesh, MeshSpec


@dataclasses.dataclass(frozen=True)
class Setup:
    preset: str
    dtype: str
    batch: int
    prompt_len: int
    max_tokens: int  # room for the longest answer any schema allows
    tool_tokens: int
    default_prompts: int
    default_tokens: int


GPU = Setup("llama3-8b", "bfloat16", 64, 256, 400, 600, 16, 64)
DRY = Setup("tiny-llama", "float32", 4, 16, 400, 600, 2, 8)
TOPICS = dtypes.TOPICS
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                       "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "lookup_topic", "parameters": {
        "type": "object", "properties": {"topic": {"type": "string", "pattern": "^[a-z-]{1,20}$"}},
        "required": ["topic"], "additionalProperties": False}}},
]  # fmt: skip


def schema_for(i: int) -> dict:
    """The i-th request's schema: each differs in names, enums and bounds."""
    inner = {"type": "object",
             "properties": {f"level_{i}": {"enum": [f"v{i}", f"w{i}", "x"]},
                            "count": {"type": "integer", "minimum": 0, "maximum": 10 + i}},
             "required": [f"level_{i}", "count"], "additionalProperties": False}  # fmt: skip
    properties = {
        "name": {"type": "string", "maxLength": 4 + i % 9},
        "kind": {"enum": ["alpha", "beta", f"kind{i}"][: 2 + i % 2]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "minItems": 1, "maxItems": 1 + i % 3},
        "ok": {"type": "boolean"},
        f"item_{i}": inner,
    }  # fmt: skip
    if i % 4 == 0:
        properties["scores"] = {
            "type": "array",
            "maxItems": 3,
            "items": {"type": "integer", "minimum": -5, "maximum": 5},
        }
    return {"type": "object", "properties": properties, "required": sorted(properties),
            "additionalProperties": False}  # fmt: skip


def timed_generate(llm: LLM, prompts, params) -> tuple[float, list]:
    sync(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(llm)
    return time.perf_counter() - start, outs


def constrained(section: Sections, setup: Setup, profile: bool = False) -> dict:
    import jsonschema  # a test dependency here; on a GPU machine, carried as a wheel

    folder, load_format = preset_folder(section.tmp, setup.preset)
    llm = LLM(folder, dtype=setup.dtype, device=section.device, load_format=load_format,
              max_num_seqs=setup.batch, gpu_memory_utilization=0.5)  # fmt: skip
    try:
        vocab = llm.engine.model_config.vocab_size
        prompts = random_prompts(setup.batch, setup.prompt_len, vocab, seed=7)
        schemas = [schema_for(i) for i in range(setup.batch)]
        params = [SamplingParams(max_tokens=setup.max_tokens, temperature=0,
                                 structured_output=StructuredOutput.json_schema(s))
                  for s in schemas]  # fmt: skip
        first, _ = timed_generate(llm, prompts, params)  # compiles the schemas
        with MaskClock() as clock:
            seconds, outs = timed_generate(llm, prompts, params)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        timed_generate(llm, prompts, plain)  # the same shapes once before timing
        with MaskClock() as plain_clock:
            plain_seconds, plain_outs = timed_generate(llm, prompts, plain)
        if profile:  # both runs again, under the profiler
            cuda = section.device == "cuda"
            profiles = {
                "constrained": profiled(lambda: timed_generate(llm, prompts, params),
                                        clock.runs, cuda),
                "unconstrained": profiled(lambda: timed_generate(llm, prompts, plain),
                                          plain_clock.runs, cuda),
            }  # fmt: skip
    finally:
        llm.close()
    invalid = []
    for i, (out, schema) in enumerate(zip(outs, schemas)):
        answer = out.outputs[0]
        try:
            jsonschema.validate(json.loads(answer.text), schema)
            if answer.finish_reason != "stop":
                raise ValueError(f"finished by {answer.finish_reason}")
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append({"request": i, "error": str(exc)[:200], "text": answer.text[:200]})
    assert [len(o.outputs[0].token_ids) for o in plain_outs] == lengths
    tokens = sum(lengths)
    result = {
        "requests": setup.batch, "tokens": tokens,
        "mean_tokens": tokens / setup.batch, "first_run_seconds": first,
        "constrained_tokens_per_s": tokens / seconds,
        "unconstrained_tokens_per_s": tokens / plain_seconds,
        "ratio": plain_seconds / seconds,
        "valid": setup.batch - len(invalid), "invalid": invalid,
        "mask_steps": clock.steps,
        "mask_ms_per_step": clock.seconds / max(1, clock.steps) * 1e3,
        "mask_share_of_wall": clock.seconds / seconds,
        "engine_steps": clock.runs, "host_ms_per_step": clock.parts(),
        "unconstrained_engine_steps": plain_clock.runs,
        "unconstrained_host_ms_per_step": plain_clock.parts(),
        "example": outs[0].outputs[0].text[:300],
    }  # fmt: skip
    if profile:
        result["profile"] = profiles
    print(f"constrained {result['constrained_tokens_per_s']:.0f} tok/s, unconstrained "
          f"{result['unconstrained_tokens_per_s']:.0f} ({result['ratio']:.3f}); valid "
          f"{result['valid']} of {setup.batch}; masks {result['mask_ms_per_step']:.3f} ms a "
          f"step over {clock.steps} steps ({result['mask_share_of_wall']:.3f} of the wall)",
          flush=True)  # fmt: skip
    for label, parts in (("constrained", clock.parts()), ("unconstrained", plain_clock.parts())):
        print(f"  {label}, ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()),
              flush=True)  # fmt: skip
    if profile:
        print_compared("constrained", profiles["constrained"], profiles["unconstrained"],
                       "unconstrained")  # fmt: skip
    return result


def _check_calls(message: dict) -> list[tuple[str, dict]]:
    """(name, arguments) of each call; ValueError if one does not parse or validate."""
    import jsonschema

    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = []
    for call in message.get("tool_calls") or []:
        name = call["function"]["name"]
        if name not in params:
            raise ValueError(f"a call of an unknown tool {name!r}")
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, params[name])
        calls.append((name, arguments))
    if not calls:
        raise ValueError("no call")
    return calls


async def _ask_tools(url: str, model: str, setup: Setup) -> list[dict]:
    import httpx

    async def one(client, i: int) -> dict:
        body = {"model": model, "max_tokens": setup.tool_tokens, "tools": TOOLS,
                "tool_choice": "required", "parallel_tool_calls": i % 2 == 0,
                "messages": [{"role": "user",
                              "content": f"Tell me about {TOPICS[i % 8]}."}]}  # fmt: skip
        resp = await client.post(f"{url}/v1/chat/completions", json=body)
        resp.raise_for_status()
        return resp.json()["choices"][0]

    limits = httpx.Limits(max_connections=setup.batch)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(setup.batch)))


def tools(section: Sections, setup: Setup) -> dict:
    folder, load_format = preset_folder(section.tmp, setup.preset)
    argv = ["--device", section.device, "--dtype", setup.dtype, "--load-format", load_format,
            "--max-num-seqs", str(setup.batch)]  # fmt: skip
    spec = MeshSpec(model=str(folder), workers=1, port=0, kvstore=False, engine_argv=argv)
    mesh = Mesh(spec).start(timeout=900)  # a first start on a GPU compiles the kernels
    try:
        start = time.perf_counter()
        choices = asyncio.run(_ask_tools(mesh.url, folder.name, setup))
        seconds = time.perf_counter() - start
    finally:
        mesh.stop()
    bad, calls = [], 0
    for i, choice in enumerate(choices):
        try:
            calls += len(_check_calls(choice["message"]))
            if choice["finish_reason"] != "tool_calls":
                raise ValueError(f"finished by {choice['finish_reason']}")
        except (ValueError, KeyError) as exc:
            bad.append({"request": i, "error": str(exc)[:200],
                        "message": json.dumps(choice.get("message"))[:300]})  # fmt: skip
    result = {"requests": setup.batch, "seconds": seconds, "calls": calls,
              "valid": setup.batch - len(bad), "invalid": bad}  # fmt: skip
    print(f"tools: {result['valid']} of {setup.batch} answers valid, {calls} calls, "
          f"{seconds:.1f} s", flush=True)  # fmt: skip
    return result


def default_dtypes(section: Sections, setup: Setup) -> dict:
    prompts = dtypes.prompts(setup.default_prompts)
    return dtypes.default_dtypes(str(ensure_default_model()), prompts, setup.default_tokens,
                                 section.device)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--profile", action="store_true",
                        help="constrained: both runs again under torch.profiler")  # fmt: skip
    parser.add_argument("--switch-interval", type=float,
                        help="the interpreter's switch interval (seconds) for the run")  # fmt: skip
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    setup = GPU if args.device == "cuda" else DRY
    setup_info = {**dataclasses.asdict(setup), "switch_interval": sys.getswitchinterval()}
    with Sections(args, script="structured", setup=setup_info) as section:
        section("ceilings", lambda: ceilings.measure(section.device))
        section("constrained", lambda: constrained(section, setup, args.profile))
        section("tools", lambda: tools(section, setup))
        section("default_dtypes", lambda: default_dtypes(section, setup))
        return section.results


if __name__ == "__main__":
    main()
