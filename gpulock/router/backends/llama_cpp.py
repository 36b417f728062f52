"""llama.cpp in this process (llama-cpp-python): the cpu and gpu tiers.

A gpu-tier call waits in gpulock's line for its GPU with ``need`` = the model's VRAM estimate
(warming the GGUF into the page cache meanwhile, see ``gpulock.lock.prefetch``), loads the model if
it is not loaded, registers it as a resident (so the watchdog and other agents can see it and
ask for it back), runs, and gives the GPU back.  Between calls the model stays
loaded (``persistent``: evictable while idle; the next call reloads it) or is unloaded at once
(``cold-start``: the memory is checked free again before the call returns).  cpu-tier models take
no lock and register nothing.

``llama_cpp`` is imported on the first load, so choosing a route costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpulock import acquire
from gpulock.core import devices
from gpulock.core.errors import GpulockError, LockTimeout
from gpulock.core.extras import install_hint
from gpulock.core.settings import Settings
from gpulock.residents.adapters import unload_llama
from gpulock.router.backends import BackendError, Result
from gpulock.router.backends.llama_log import install_log_tap, is_oom, log_mark, log_since
from gpulock.router.backends.llama_tally import tallied
from gpulock.router.routes import Candidate

VERIFY_S = 5.0  # how long a cold-start unload may take to show on NVML
SPLIT_MODE_NONE = 0  # llama.cpp's LLAMA_SPLIT_MODE_NONE: the whole model on main_gpu
_lock = threading.Lock()


def _llama_class() -> Any:
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        raise GpulockError(
            f"llama-cpp-python is not installed ({e})",
            hint=install_hint("llama"),
        ) from None
    install_log_tap(llama_cpp)
    return Llama


class LlamaBackend:
    """One model file with one context size, loaded at most once in this process."""

    def __init__(
        self,
        c: Candidate,
        settings: Settings,
        *,
        gpu: int | None,
        need: int | None,
        gpus: Sequence[int] = (),
    ):
        self.candidate = c
        self.settings = settings
        self.gpu = gpu if c.tier == "gpu" else None
        # A candidate without gpu: on a machine of several: its ticket waits for the set (one
        # line); the model loads where the ticket is granted and keeps that GPU while loaded.
        self.gpus = tuple(gpus) if c.tier == "gpu" and len(gpus) > 1 else ()
        self.need = need
        self._llm: Any = None
        self._resident: Any = None
        # llama.cpp contexts are not thread-safe; re-entrant: a cold-start call unloads inside
        self._call_lock = threading.RLock()
        self.loads = 0

    @property
    def loaded(self) -> bool:
        if self._resident is not None:
            return bool(self._resident.loaded)
        return self._llm is not None

    # --- the calls ---------------------------------------------------------------------------

    def complete(self, prompt: str, *, wait_s: float | None, label: str, **kw: Any) -> Result:
        return self._run(lambda llm: llm.create_completion(prompt, **kw), "text", wait_s, label)

    def chat(
        self, messages: list[dict[str, Any]], *, wait_s: float | None, label: str, **kw: Any
    ) -> Result:
        return self._run(
            lambda llm: llm.create_chat_completion(messages=messages, **kw), "chat", wait_s, label
        )

    def chat_tools(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]],
        tool_choice: Any,
        chat_format: str,
        wait_s: float | None,
        label: str,
        **kw: Any,
    ) -> Result:
        """A chat that may call ``tools``, through llama-cpp-python's function-calling chat
        handler ``chat_format`` (``chatml-function-calling``, ``functionary``...): the model's
        own chat template renders tools at best, and nothing parses its calls back out."""

        def call(llm: Any) -> Any:
            from llama_cpp import llama_chat_format

            handler: Any = llama_chat_format.get_chat_completion_handler(chat_format)
            return handler(llama=llm, messages=messages, tools=tools, tool_choice=tool_choice, **kw)

        return self._run(call, "chat", wait_s, label)

    def stream(
        self,
        kind: str,
        payload: Any,
        *,
        wait_s: float | None,
        label: str,
        usage: dict[str, int],
        **kw: Any,
    ) -> Iterator[str]:
        """Yield text pieces as they are generated; ``usage`` gets the token counts, as the
        same call unstreamed reports them: the tokens the model processed (the prompt after
        the chat template) and generated (``tallied``), counted as they go, so a stream the
        caller stops early is counted with what it got."""
        with self._session(wait_s, label) as llm, tallied(llm, usage):
            mark = log_mark()
            try:
                if kind == "chat":
                    chunks = llm.create_chat_completion(messages=payload, stream=True, **kw)
                else:
                    chunks = llm.create_completion(payload, stream=True, **kw)
                for chunk in chunks:  # llama.cpp raises here, at the first piece, not above
                    choice = (chunk.get("choices") or [{}])[0]
                    piece = choice.get("text")
                    if piece is None:
                        piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece
            except (RuntimeError, ValueError, OSError) as e:
                # A prompt longer than the context (a context halved at governor level reduce,
                # say) is a failure of this candidate, to fall back from, as in _run.
                self._failed(e, "server", log_since(mark))

    def _run(
        self, call: Callable[[Any], Any], kind: str, wait_s: float | None, label: str
    ) -> Result:
        with self._session(wait_s, label) as llm:
            mark = log_mark()
            try:
                out = call(llm)
            except (RuntimeError, ValueError, OSError) as e:
                self._failed(e, "server", log_since(mark))
        choice = out["choices"][0]
        text = choice["text"] if kind == "text" else (choice["message"].get("content") or "")
        usage = out.get("usage") or {}
        return Result(
            text, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), out
        )

    @contextlib.contextmanager
    def _session(self, wait_s: float | None, label: str) -> Iterator[Any]:
        """The loaded model for one call: under the GPU lock on the gpu tier."""
        with self._call_lock:
            if self.gpu is None:
                if self._llm is None:
                    self._llm = self._load()
                try:
                    yield self._llm
                finally:
                    if self.candidate.policy == "cold-start":
                        self.unload()
                return
            try:
                lease = acquire(
                    gpu=self._ask(),
                    need=self.need,
                    timeout=wait_s,
                    name=label,
                    config=self.settings.config,
                    state_dir=self.settings.state_dir,
                    prefetch=self._prefetch(),
                )
            except LockTimeout as e:
                raise BackendError("busy", str(e)) from None
            with lease:
                self._on(lease.gpu)
                if self._resident is None:
                    self._resident = self._register()
                try:
                    with self._resident.use() as llm:
                        yield llm
                finally:
                    # A failed call too: cold-start leaves nothing loaded, whatever happened.
                    if self.candidate.policy == "cold-start":
                        self.unload()

    def _ask(self) -> int | list[int] | None:
        """What its ticket waits for: the GPU its model is loaded on, else its set."""
        if self.gpus and not self.loaded:
            return list(self.gpus)
        return self.gpu

    def _on(self, gpu: int) -> None:
        """Granted ``gpu`` of its set: the model is (re)registered and loaded there."""
        if not self.gpus or gpu == self.gpu:
            return
        if self._resident is not None:  # evicted from the GPU it had: let its record go
            res, self._resident = self._resident, None
            res.release()
        self.gpu = gpu

    def _prefetch(self) -> list[str]:
        """The GGUF to warm while the call waits in line: only when it will be loaded (a model
        already loaded reads nothing) and readable (else the load reports why)."""
        path = self.candidate.model
        if self.loaded or not os.path.isfile(path) or not os.access(path, os.R_OK):
            return []
        return [path]

    # --- loading and unloading ---------------------------------------------------------------

    def _load(self) -> Any:
        c = self.candidate
        if not os.path.isfile(c.model):
            raise BackendError("load", f"model file not found: {c.model} ({c.key}.model)")
        Llama = _llama_class()
        kwargs: dict[str, Any] = {
            "model_path": c.model,
            "n_ctx": c.n_ctx,
            "n_batch": min(c.n_batch, c.n_ctx),
            "n_gpu_layers": c.n_gpu_layers,
            "verbose": False,
        }
        if c.n_threads:
            kwargs["n_threads"] = c.n_threads
        kwargs.update(self._placement())
        start = time.monotonic()
        mark = log_mark()
        try:
            with _lock:  # llama.cpp's backend init is not safe to run twice at once
                llm = Llama(**kwargs)
        except (RuntimeError, ValueError, OSError) as e:
            self._failed(e, "load", log_since(mark))
        self.loads += 1
        self.settings.emit(
            "model-load",
            task=c.task,
            model=c.name,
            path=c.model,  # the GGUF: what pre-warming reads into the page cache next time
            tier=c.tier,
            gpu=self.gpu,
            n_ctx=c.n_ctx,
            need_bytes=self.need,
            load_s=round(time.monotonic() - start, 6),
        )
        return llm

    def _placement(self) -> dict[str, Any]:
        """On a real machine of several GPUs, a model of a set loads on the GPU granted alone:
        llama.cpp's ``main_gpu`` (as CUDA numbers it in this process) and no split."""
        if not self.gpus or self.gpu is None or devices.simulated_sizes(self.settings.config):
            return {}
        # gpulock numbers GPUs as NVML does; CUDA too, told before it starts (see runner).
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        seen = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if seen.strip():
            ids = [int(x) for x in seen.split(",") if x.strip().isdigit()]
            if self.gpu not in ids:
                return {}  # not visible here: llama.cpp decides, as without a set
            index = ids.index(self.gpu)
        else:
            index = self.gpu
        return {"main_gpu": index, "split_mode": SPLIT_MODE_NONE}

    def _failed(self, e: BaseException, kind: str, log: Sequence[str] = ()) -> Any:
        """Raise the BackendError for ``e``; ``log``: llama.cpp's lines meanwhile (the why)."""
        text = str(e) or type(e).__name__
        detail = next((line for line in reversed(log) if is_oom(line)), None)
        if detail is None and log:
            detail = log[-1]
        if detail and detail not in text:
            text = f"{text} ({detail})"
        if "exceed context window" in text:
            raise BackendError("request", f"{self.candidate.name}: {text}", detail=text) from e
        if is_oom(text):
            if self._resident is not None:
                self._resident.report_oom()
            elif self.gpu is not None:
                self.settings.emit("oom", name=self.candidate.name, gpu=self.gpu)
            raise BackendError(
                "oom", f"{self.candidate.name}: out of memory: {text}", detail=text
            ) from e
        raise BackendError(kind, f"{self.candidate.name}: {text}", detail=text) from e

    # Appended to the candidate's name for its resident record: a second instance of one
    # model (serve's embeddings context) must not show as a twin of the first.
    resident_suffix = ""

    def _register(self) -> Any:
        from gpulock.residents.owner import resident

        c = self.candidate
        return resident(
            c.name + self.resident_suffix,
            gpu=self.gpu,
            bytes=self.need,
            load=self._load,
            unload=unload_llama,
            policy="cold-start" if c.policy == "cold-start" else "persistent",
            config=self.settings.config,
            state_dir=self.settings.state_dir,
        )

    def unload(self) -> None:
        """Free the model now (after a call in progress in another thread); the next call loads
        it again."""
        with self._call_lock:
            self._unload()

    def _unload(self) -> None:
        if self._resident is not None:
            res, self._resident = self._resident, None
            baseline = self._process_gpu_bytes()
            res.release()
            self._verify_freed(baseline)
        elif self._llm is not None:
            llm, self._llm = self._llm, None
            unload_llama(llm)

    def _process_gpu_bytes(self) -> int | None:
        if self.gpu is None:
            return None
        report = devices.probe(self.settings.config)
        if report.source != "nvml":
            return None  # simulated GPUs count the registry, which release() has just updated
        return devices.process_used_bytes(report, self.gpu, os.getpid())

    def _verify_freed(self, before: int | None) -> None:
        """On a real GPU, wait until NVML shows this process's memory gone down (cold-start)."""
        if before is None or self.need is None:
            return
        deadline = time.monotonic() + VERIFY_S
        now_bytes = before
        while time.monotonic() < deadline:
            now_bytes = self._process_gpu_bytes() or 0
            if now_bytes <= max(0, before - self.need // 2):
                break
            time.sleep(0.05)
        self.settings.emit(
            "unload-verify",
            model=self.candidate.name,
            gpu=self.gpu,
            before_bytes=before,
            after_bytes=now_bytes,
            freed=now_bytes < before,
        )


_cache: dict[tuple[Any, ...], LlamaBackend] = {}


def backend_for(
    c: Candidate,
    settings: Settings,
    *,
    gpu: int | None,
    need: int | None,
    gpus: Sequence[int] = (),
) -> LlamaBackend:
    """This process's backend for a candidate: persistent models are shared between handles.

    One copy of a model per process: when the governor's ``reduce`` asks for a smaller context
    while the model is loaded with a larger one, the loaded one serves (a second, smaller copy
    would add memory at the very moment memory is short); when a larger context is asked for
    than the loaded one has, the loaded one is unloaded before the new one loads.
    """
    where = tuple(gpus) if len(gpus) > 1 else gpu  # a set: one backend, wherever it loads
    same = (c.model, c.tier, c.policy, c.n_gpu_layers, where, str(settings.state_dir))
    key = (*same, c.n_ctx, c.n_batch)
    with _lock:
        b = _cache.get(key)
        others = [o for k, o in _cache.items() if k[:-2] == same and k != key and o.loaded]
        if b is None or not b.loaded:
            roomy = next((o for o in others if o.candidate.n_ctx >= c.n_ctx), None)
            if roomy is not None:
                return roomy
        if b is None:
            b = _cache[key] = LlamaBackend(c, settings, gpu=gpu, need=need, gpus=gpus)
    for o in others:  # outside _lock: a reload inside another call may need it
        o.unload()
    return b


def loaded_models() -> set[str]:
    """cids of the models loaded in this process now (the chooser prefers a warm model)."""
    from gpulock.router.choose import cid

    with _lock:
        return {cid(b.candidate) for b in _cache.values() if b.loaded}
