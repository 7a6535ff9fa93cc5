"""Generation stage UDFs: prompts -> conversations (one output row per input row).

`GenerateUDF` is a Ray Data actor class: it loads the target in vLLM once in `__init__`
and regenerates the final assistant turn of each prompt in `__call__`. `LoggedUDF` is the
"keep logged responses" mode (no engine). Both return rows of `CONVERSATIONS_SCHEMA`;
rows that cannot be generated come back with status="rejected" and a reason, so one bad
prompt never stops a batch, and a batch never stops the job.

Token contract for later stages: the training sequence is exactly
`prompt_token_ids + completion_token_ids` (what the target saw and emitted, end-of-turn
token included when it stopped on it); the loss covers `completion_token_ids`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
from typing import Any

import pyarrow as pa

from eagle_ray.common.errors import UserFault
from eagle_ray.data.chat import load_tools, render

logger = logging.getLogger(__name__)

INPUT_COLUMNS = ("sample_id", "source", "messages", "reference", "tools")

CONVERSATIONS_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("source", pa.string()),
    pa.field("status", pa.string(), nullable=False),  # "ok" | "rejected"
    pa.field("reason", pa.string()),                  # reject reason code
    pa.field("message", pa.string()),                 # reject reason, human text
    pa.field("origin", pa.string()),                  # "regenerated" | "logged"
    pa.field("messages", pa.string()),                # JSON: prompt + the final assistant turn
    pa.field("completion_text", pa.string()),         # exactly what the target generated
    pa.field("reasoning_content", pa.string()),
    pa.field("content", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("completion_token_ids", pa.list_(pa.int32())),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_completion_tokens", pa.int32()),
    # For stats/plan: the training window after end-truncation at data.max_seq_len.
    pa.field("num_tokens", pa.int32()),
    pa.field("num_loss_tokens", pa.int32()),
    pa.field("truncated", pa.bool_()),
    pa.field("tools", pa.string()),                   # JSON: the request's tool specs (null: none)
    # Which completion tokens are in the loss (null: all; data.train_turns=all sets it):
    # extract.stage.MASK_COLUMN.
    pa.field("completion_loss_mask", pa.list_(pa.bool_())),
    # Tokens of history dropped to fit data.max_seq_len (data.long_sessions=cut_history; 0:
    # none): `messages` holds the session as trained on.
    pa.field("history_cut_tokens", pa.int32()),
    # JSON: the calls in a regenerated turn, parsed back with the target's vLLM tool parser
    # (serve.tool_call_parser), as the OpenAI server would return them (null: none).
    pa.field("tool_calls", pa.string()),
])


def parse_tool_calls(parser_name: str, tokenizer, tools: list[dict] | None,
                     text: str) -> tuple[str | None, list[dict] | None]:
    """(content, calls) of generated text, by vLLM's own tool parser (`--tool-call-parser`),
    as vLLM's OpenAI server splits a completion; (text, None) when it holds no call. Ids the
    text does not carry (Hermes writes none; the parser invents random ones) become
    `functions.NAME:IDX`, as ingest names unnamed calls, so a re-run writes the same table."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    request = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], model="target",
                                    tools=tools)
    got = ToolParserManager.get_tool_parser(parser_name)(tokenizer, request.tools) \
        .extract_tool_calls(text, request)
    if not got.tools_called or not got.tool_calls:
        return text, None
    calls = [{"id": c.id if c.id and c.id in text else f"functions.{c.function.name}:{i}",
              "type": "function",
              "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for i, c in enumerate(got.tool_calls)]
    return got.content, calls


def split_reasoning(text: str, think_start: str, think_end: str,
                    started_in_prompt: bool = False) -> tuple[str | None, str]:
    """(reasoning_content, content) of generated text; the exact text is kept separately.

    `started_in_prompt`: the chat template's generation prompt already opened the reasoning
    block (DeepSeek-R1 style), so the text begins inside it.
    """
    body = text
    if not started_in_prompt:
        stripped = body.lstrip()
        if not stripped.startswith(think_start):
            return None, text
        body = stripped[len(think_start):]
    head, sep, tail = body.partition(think_end)
    if not sep:  # stopped (length) inside the reasoning block
        return head.strip("\n") or None, ""
    return head.strip("\n") or None, tail.lstrip("\n")


def _record_generated(table: pa.Table) -> None:
    """Replica-side metrics of one finished batch: prompts by status, completion tokens,
    rejects by reason."""
    import collections

    import pyarrow.compute as pc

    from eagle_ray.ops.metrics import record

    status = collections.Counter(table.column("status").to_pylist())
    for st, n in status.items():
        record("eagle_ray_prompts_generated", n, stage="generate", status=st)
    record("eagle_ray_completion_tokens",
           pc.sum(table.column("num_completion_tokens")).as_py() or 0, stage="generate")
    for reason, n in collections.Counter(r for r in table.column("reason").to_pylist() if r).items():
        record("eagle_ray_rejects", n, stage="generate", reason=reason)


def _row(sample_id: str, source: str | None, **kw: Any) -> dict[str, Any]:
    row = {name: None for name in CONVERSATIONS_SCHEMA.names}
    row.update(sample_id=sample_id, source=source, **kw)
    return row


def rejected(sample_id: str, source: str | None, reason: str, message: str) -> dict[str, Any]:
    return _row(sample_id, source, status="rejected", reason=reason, message=message)


def fit_session(tokenizer, recipe, messages: list[dict[str, Any]], tools, n_tokens: int, *,
                prompt: bool) -> tuple[list[dict[str, Any]], int]:
    """`messages` (`n_tokens` long as rendered) cut to fit the training window
    (data.long_sessions=cut_history, `data.chat.cut_history`) and the tokens dropped. A whole
    session (keep-logged, `prompt` False) must fit data.max_seq_len; a prompt (regenerate)
    must leave room to generate a quarter of the window (or generate.max_tokens if less). The
    last unit before the end (what the final turn answers) is always kept."""
    from eagle_ray.data.chat import cut_history, history_units

    window = recipe.data.max_seq_len
    budget = window - min(recipe.generate.max_tokens, max(1, window // 4)) if prompt else window
    if recipe.data.long_sessions != "cut_history" or n_tokens <= budget:
        return messages, 0
    final = len(messages) if prompt else len(messages) - 1
    _, units = history_units(messages, final)
    tail_from = units[-1][0] if units and units[-1][1] == final else final
    # A cut is the head plus a suffix, so its length names it: each is rendered once.
    counted = {len(messages): n_tokens}

    def count(msgs):
        if len(msgs) not in counted:
            text = render(tokenizer, [msgs], [tools], add_generation_prompt=prompt)[0]
            counted[len(msgs)] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return counted[len(msgs)]

    out, dropped = cut_history(count, messages, tail_from, budget)
    return out, (n_tokens - count(out)) if dropped else 0


def _window(n_prompt: int, n_completion: int, max_seq_len: int,
            completion_mask: list[bool] | None = None) -> dict[str, Any]:
    n = n_prompt + n_completion
    kept = min(n, max_seq_len) - n_prompt  # completion tokens inside the window
    loss = (max(0, kept) if completion_mask is None else sum(completion_mask[:max(0, kept)]))
    return {"num_tokens": min(n, max_seq_len), "num_loss_tokens": loss,
            "truncated": n > max_seq_len}


class _Base:
    def __init__(self, recipe, model_path: str):
        from transformers import AutoTokenizer

        self.recipe = recipe
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, revision=recipe.target.revision,
            trust_remote_code=recipe.target.trust_remote_code)
        # Lengths are judged against the engine's context (prompt_too_long) and
        # data.max_seq_len, not the tokenizer's model_max_length: without this, every replica
        # warns on the console at its first long agent session.
        self.tokenizer.model_max_length = sys.maxsize
        self.tokenizer_lock = threading.Lock()

    def _table(self, rows: list[dict[str, Any]]) -> pa.Table:
        return pa.Table.from_pylist(rows, schema=CONVERSATIONS_SCHEMA)


class Regenerate(_Base):
    """Prompt rows -> requests, and finished requests -> conversation rows; the engine that
    runs the requests is the subclass's (GenerateUDF: a vLLM engine of its own; the colocated
    stage: the capture engine, see eagle_ray/stream/colocated.py)."""

    def _init_sampling(self, max_model_len: int, model_path: str) -> None:
        from vllm import SamplingParams

        from eagle_ray.data.ids import sample_seed
        from eagle_ray.targets.serving import generation_sampling, sampling_kwargs

        self.max_model_len = max_model_len
        self.sampling = generation_sampling(self.recipe, model_path)
        kw, seed = sampling_kwargs(self.sampling), self.sampling["seed"]
        greedy = self.sampling["temperature"] == 0
        # One seed per sample (not per engine): a completion is the same whichever batch or
        # replica draws it, and the N completions of a prompt differ.
        self._sampling = lambda max_tokens, sid: SamplingParams(
            **kw, max_tokens=max_tokens, seed=None if greedy else sample_seed(seed, sid),
            skip_special_tokens=False)

    def _expand(self, batch: pa.Table) -> pa.Table:
        """Prompt rows -> one row per completion to draw, the rows of a prompt together in
        this batch: N = generate.samples_per_prompt completions, ids `<prompt id>#<j>`; with
        data.train_turns=all, N for every logged assistant turn of the session too
        (`data.chat.assistant_turns`: the row's `messages` cut to the history that turn
        answered) and N for the end of the session, ids `<prompt id>#<t * N + j>`
        (`data.ids.turn_completion_id`): each turn is regenerated from the logged history
        before it, as the served target would have answered there."""
        from eagle_ray.data.chat import assistant_turns
        from eagle_ray.data.ids import completion_id, turn_completion_id

        n = self.recipe.generate.samples_per_prompt
        every_turn = self.recipe.regenerates_every_turn
        if n == 1 and not every_turn:
            return batch
        take, ids, msgs = [], [], []
        for i, (pid, m) in enumerate(zip(batch.column("sample_id").to_pylist(),
                                         batch.column("messages").to_pylist())):
            if every_turn:
                session = json.loads(m)
                ends = assistant_turns(session) + [len(session)]
                turns = [(t, m if end == len(session) else json.dumps(session[:end], ensure_ascii=False))
                         for t, end in enumerate(ends)]
            else:
                turns = [(0, m)]
            for t, prefix in turns:
                for j in range(n):
                    take.append(i)
                    ids.append(turn_completion_id(pid, t, j, n) if every_turn else completion_id(pid, j, n))
                    msgs.append(prefix)
        out = batch.take(pa.array(take, pa.int64()))
        for name, values in (("sample_id", ids), ("messages", msgs)):
            out = out.set_column(out.schema.get_field_index(name), name, pa.array(values, pa.string()))
        return out

    def _prepare(self, batch: pa.Table):
        """(cols, rows rejected up front, [(row index, params, prompt ids, messages,
        reasoning started in the prompt, history tokens cut)] to run), over the batch's
        completion rows."""
        g = self.recipe.generate
        batch = self._expand(batch)
        rows: dict[int, dict[str, Any]] = {}
        todo: list[tuple[int, Any, list[int], list[dict], bool, int]] = []
        cols = {c: batch.column(c).to_pylist() for c in INPUT_COLUMNS}
        for i, (sid, src, messages_json) in enumerate(zip(cols["sample_id"], cols["source"],
                                                          cols["messages"])):
            messages = json.loads(messages_json)
            tools = load_tools(cols["tools"][i])
            if not any(m.get("role") == "user" for m in messages):  # a turn before any user's
                rows[i] = rejected(sid, src, "no_user_message",
                                   "the history this assistant turn answers has no user message")
                continue
            with self.tokenizer_lock:  # batches run in threads; HF fast tokenizers are not re-entrant
                text = render(self.tokenizer, [messages], [tools], add_generation_prompt=True)[0]
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                messages, cut = fit_session(self.tokenizer, self.recipe, messages, tools, len(ids),
                                            prompt=True)
                if cut:
                    text = render(self.tokenizer, [messages], [tools], add_generation_prompt=True)[0]
                    ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            # Training sees the first data.max_seq_len tokens of a sample (extraction cuts the
            # rest), so tokens generated past it would be paid for and thrown away.
            limit = min(self.max_model_len, self.recipe.data.max_seq_len)
            room = limit - len(ids)
            if room < 1:
                what = ("the context limit" if limit == self.max_model_len
                        else "data.max_seq_len (the training window)")
                rows[i] = rejected(sid, src, "prompt_too_long",
                                   f"prompt has {len(ids):,} tokens; {what} is {limit:,}, "
                                   "leaving no room to generate")
                continue
            params = self._sampling(min(g.max_tokens, room), sid)
            started = text.rstrip().endswith(g.think_start)
            todo.append((i, params, ids, messages, started, cut))
        return cols, rows, todo

    def _finish(self, cols, rows, todo, outputs) -> pa.Table:
        """Conversation rows, in input order; an engine error costs its row only."""
        table = self._finish_rows(cols, rows, todo, outputs)
        _record_generated(table)
        return table

    def _finish_rows(self, cols, rows, todo, outputs) -> pa.Table:
        g, max_seq_len = self.recipe.generate, self.recipe.data.max_seq_len
        for (i, _, ids, messages, started, cut), out in zip(todo, outputs):
            sid, src = cols["sample_id"][i], cols["source"][i]
            if isinstance(out, Exception):
                rows[i] = rejected(sid, src, "engine_error", f"{type(out).__name__}: {out}"[:2000])
                continue
            c = out.outputs[0]
            completion = list(c.token_ids)
            reasoning, content = split_reasoning(c.text, g.think_start, g.think_end, started)
            calls = None
            parser = self.recipe.serve.tool_call_parser
            if parser and cols["tools"][i] and content:
                try:
                    with self.tokenizer_lock:
                        content, calls = parse_tool_calls(parser, self.tokenizer,
                                                          load_tools(cols["tools"][i]), content)
                except Exception as e:  # the completion is kept as text: a parse is extra
                    logger.warning("%s: vLLM's %s tool parser failed on its completion (%s: %s); "
                                   "kept as text", sid, parser, type(e).__name__, e)
            turn = {"role": "assistant", "content": content}
            if calls:
                turn["tool_calls"] = calls
            if reasoning is not None:
                turn["reasoning_content"] = reasoning
            rows[i] = _row(sid, src, status="ok", origin="regenerated", tools=cols["tools"][i],
                           history_cut_tokens=cut,
                           messages=json.dumps(messages + [turn], ensure_ascii=False),
                           completion_text=c.text, reasoning_content=reasoning, content=content,
                           tool_calls=json.dumps(calls, ensure_ascii=False) if calls else None,
                           finish_reason=c.finish_reason, prompt_token_ids=ids,
                           completion_token_ids=completion, num_prompt_tokens=len(ids),
                           num_completion_tokens=len(completion),
                           **_window(len(ids), len(completion), max_seq_len))
        out = [rows[i] for i in range(len(cols["sample_id"]))]
        if self.recipe.generate.samples_per_prompt > 1:
            _drop_duplicate_completions(out, self.recipe.generate.samples_per_prompt)
        return self._table(out)


class EngineDied(UserFault, RuntimeError):
    """A generation replica's vLLM engine died; the message names vLLM's own exception."""


def _engine_death(cause_file: str) -> str:
    try:
        cause = open(cause_file).read().strip()
    except OSError:
        cause = ""
    return ("the vLLM engine of a generation replica died: "
            + (cause or "no cause recorded (see the replica's log: `ray logs`)")
            + "; nothing of the batches in flight was written, a re-run regenerates them")


def _drop_duplicate_completions(rows: list[dict[str, Any]], n: int) -> None:
    """A completion equal to an earlier one of the same prompt and turn (token for token; N =
    `n` completions a turn) is kept once: the later ones become rejects
    (duplicate_completion), so they are counted, not trained on twice. All completions of a
    prompt are in one batch, so this is exact."""
    from eagle_ray.data.ids import prompt_id, turn_index

    seen: dict[tuple, str] = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        sid = r["sample_id"]
        key = (prompt_id(sid), turn_index(sid, n), tuple(r["completion_token_ids"]))
        if key in seen:
            r.update(rejected(r["sample_id"], r["source"], "duplicate_completion",
                              f"the same completion as {seen[key]} of the same prompt"))
        else:
            seen[key] = r["sample_id"]


def _stop_output_handler(engine, timeout_s: float = 10.0) -> None:
    """End AsyncLLM's output handler before its engine core goes away.

    `AsyncLLM.shutdown()` (vLLM 0.32) stops the engine core first and cancels the handler
    after; the handler, still awaiting the core's next output, sees the closed sockets as a
    dead engine and logs `AsyncLLM output_handler failed ... EngineDeadError` with a traceback
    in every successful run. Cancelled first, on its own event loop (Ray Data runs an async
    UDF's loop in a thread of its own; this runs on the actor's exit thread), it ends quietly."""
    import contextlib

    task = getattr(engine, "output_handler", None)
    if task is None or task.done():
        return
    loop = task.get_loop()
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop or loop.is_closed() or not loop.is_running():
        task.cancel()  # raised into the handler at its next await, before any engine error
        return

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    try:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout_s)
    except Exception as e:  # a loop that stopped meanwhile: shutdown proceeds regardless
        logger.debug("output handler stop: %r", e)


def _close_if_alive(ref) -> None:
    udf = ref()
    if udf is not None:
        udf.close()


class GenerateUDF(Regenerate):
    """Regenerates the final assistant turn with the target in vLLM (one engine per actor).

    The engine is vLLM's async engine (`AsyncLLM`, what `ray.data.llm` uses): its engine
    core runs in its own process and steps continuously over every request in flight, so the
    replica's several concurrent Ray Data batches (`generate.batches_in_flight`) share one
    running batch, and on the GPU scheduling overlaps the forward passes. Measured on the CPU
    (bench/bench_engine.py): same tokens and the same tokens/s as stepping an in-process
    `vllm.LLM` by hand; the engine-core process costs ~12 s more start-up per replica. The
    stage UDF is async: Ray Data runs it on the actor's event loop, several batches at once.
    """

    def __init__(self, recipe, model_path: str):
        super().__init__(recipe, model_path)
        import atexit
        import weakref

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from eagle_ray.vllm.engine import engine_kwargs
        from eagle_ray.vllm.plugin import CAUSE_ENV

        # Where the engine core writes its exception if it dies (eagle_ray/vllm/plugin.py);
        # the engine-core process inherits the variable.
        self._cause_file = f"/tmp/eagle_ray_engine_cause_{os.getpid()}.txt"
        os.environ[CAUSE_ENV] = self._cause_file
        # vLLM's engine metrics (queue, KV cache, throughput, latencies) into Ray's metrics:
        # the dashboard and Grafana show them next to eagle_ray's (`ray_vllm_*`).
        self.engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**engine_kwargs(recipe, model_path)),
            stat_loggers=[RayPrometheusStatLogger])
        self._init_sampling(self.engine.model_config.max_model_len, model_path)
        self._seq = 0

        # Shut the engine down when the actor exits, in vLLM's order (the output handler
        # first, then the engine core), before anything kills the engine core under a
        # running output handler (a spurious EngineDeadError traceback in the job's log):
        # at interpreter exit (atexit; Ray leaves these actors' child processes alone,
        # eagle_ray.vllm.engine.CHILD_ENGINE_ENV) or when the UDF is dropped (`__del__`).
        # The atexit hook holds only a weak reference, so it does not keep the UDF alive.
        atexit.register(_close_if_alive, weakref.ref(self))

    def __del__(self):
        self.close()

    def close(self) -> None:
        cause = self.__dict__.get("_cause_file")
        if cause and os.path.exists(cause):
            os.remove(cause)
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            logger.debug("generation replica %d: shutting its vLLM engine down", os.getpid())
            try:
                _stop_output_handler(engine)
                engine.shutdown()  # the engine-core process
            except Exception as e:  # at interpreter exit vLLM's modules may be half torn down
                logger.debug("engine shutdown: %r", e)

    async def __call__(self, batch: pa.Table):
        from vllm.inputs import TokensPrompt

        from eagle_ray.ops.metrics import InFlight

        with InFlight("generate"):
            cols, rows, todo = self._prepare(batch)
            outputs = await self._generate([(TokensPrompt(prompt_token_ids=t[2]), t[1]) for t in todo])
            table = self._finish(cols, rows, todo, outputs)
        yield table

    async def _one(self, prompt, params):
        self._seq += 1
        last = None
        async for out in self.engine.generate(prompt, params, f"er-{self._seq}"):
            last = out
        return last

    async def _generate(self, requests: list) -> list:
        """Run the batch's requests concurrently; a request the engine refuses costs that row
        only. A dead engine raises, failing the batch (Ray retries it elsewhere)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        outs = await asyncio.gather(*(self._one(p, sp) for p, sp in requests),
                                    return_exceptions=True)
        for out in outs:
            if isinstance(out, EngineDeadError):
                raise EngineDied(_engine_death(self._cause_file)) from out
            if isinstance(out, BaseException) and not isinstance(out, Exception):
                raise out
        return outs


class LoggedUDF(_Base):
    """Keep-logged mode: the logged reference response becomes the final turn, tokenized
    with the target's chat template."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        from eagle_ray.data.tokenize import tokenize_conversation

        rows = []
        cols = {c: batch.column(c).to_pylist() for c in INPUT_COLUMNS}
        for sid, src, messages_json, ref_json, tools_json in zip(*(cols[c] for c in INPUT_COLUMNS)):
            if ref_json is None:
                rows.append(rejected(sid, src, "no_logged_response",
                                     "keep_logged mode needs a logged assistant response; this "
                                     "prompt has none (use mode=regenerate)"))
                continue
            messages = json.loads(messages_json) + [json.loads(ref_json)]
            every_turn = self.recipe.data.train_turns == "all"
            tools = load_tools(tools_json)
            try:
                t = tokenize_conversation(self.tokenizer, messages, sys.maxsize, tools,
                                          all_turns=every_turn)
                messages, cut = fit_session(self.tokenizer, self.recipe, messages, tools,
                                            t.num_tokens_untruncated, prompt=False)
                if cut:
                    t = tokenize_conversation(self.tokenizer, messages, sys.maxsize, tools,
                                              all_turns=every_turn)
            except ValueError as e:
                rows.append(rejected(sid, src, "template_error", str(e)))
                continue
            first = int(t.loss_mask.argmax())
            prompt_ids = t.input_ids[:first].tolist()
            # Every assistant turn: the completion runs to the end of the session, the turns
            # between (user, tool results) in it but out of the loss.
            cmask = t.loss_mask[first:].tolist() if every_turn else None
            completion = (t.input_ids[first:] if every_turn else t.input_ids[t.loss_mask]).tolist()
            ref = messages[-1]
            rows.append(_row(sid, src, status="ok", origin="logged", tools=tools_json,
                             history_cut_tokens=cut,
                             tool_calls=(json.dumps(messages[-1]["tool_calls"], ensure_ascii=False)
                                         if messages[-1].get("tool_calls") else None),
                             messages=json.dumps(messages, ensure_ascii=False),
                             completion_text=self.tokenizer.decode(completion),
                             reasoning_content=ref.get("reasoning_content"),
                             content=ref["content"], finish_reason="logged",
                             prompt_token_ids=prompt_ids, completion_token_ids=completion,
                             num_prompt_tokens=len(prompt_ids),
                             num_completion_tokens=len(completion), completion_loss_mask=cmask,
                             **_window(len(prompt_ids), len(completion),
                                       self.recipe.data.max_seq_len, cmask)))
        return self._table(rows)
