"""The `local` backend: the target model itself, in this process, with transformers ``generate``.

No server: the embedded default, so the step runs on a CPU (``make demo``) as on a GPU. Up to
``batch_size`` conversations are in progress at once; each step renders the next turn of every one
of them with the chat template, left-pads the prompts into one batch and generates. A conversation
whose turns are all done leaves the batch and the next one takes its place. The device is claimed
like a shard run claims it (one run per GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hsx_dagster.core.regenerate.run import PromptRenderer, Stats, opens_think, template_failure
from hsx_dagster.core.regenerate.turns import ConversationJob, Generated, split_reasoning
from hsx_dagster.core.settings import ExtractionSettings, RegenerateSettings


class LocalBackend:
    """The target in this process: sampling as the ``regenerate`` settings say, on the device and in the compute
    dtype of the ``extraction`` settings (the `gpu` resource), claimed like a shard run claims it."""

    name = "local"

    def __init__(
        self,
        options: RegenerateSettings,
        extraction: ExtractionSettings,
        model_path: Path,
        *,
        owner: str,
        trust_remote_code: bool = False,
    ) -> None:
        self.options, self.extraction = options, extraction
        self.model_path = Path(model_path)
        self.owner = owner
        self.trust_remote_code = trust_remote_code
        self.device_used = ""

    def preflight(self) -> dict[str, Any]:
        from hsx_dagster.core.model.info import check_model_dir

        check_model_dir(self.model_path)
        return {
            "model": str(self.model_path),
            "devices": list(self.extraction.devices),
            "batch_size": self.options.batch_size,
        }

    def run(self, jobs: Iterator[ConversationJob], finished: Callable[[ConversationJob], None], stats: Stats) -> None:
        from hsx_dagster.core.extraction.devices import claimed_device

        extraction = self.extraction
        with claimed_device(
            extraction.devices,
            0,
            owner=self.owner,
            lock_dir=extraction.device_lock_dir,
            wait_s=extraction.device_wait_s,
            claim=extraction.device_claim,
        ) as device:
            self.device_used = device
            self._run_on(device, jobs, finished, stats)

    def _run_on(self, device: str, jobs, finished, stats: Stats) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from hsx_dagster.core.extraction.shard_run import resolve_compute_dtype

        torch_device = torch.device(device)
        dtype = resolve_compute_dtype(self.extraction.compute_dtype, torch_device)
        renderer = PromptRenderer(self.model_path, self.options.chat_template_kwargs, self.trust_remote_code)
        tokenizer = renderer.tokenizer
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(
            str(self.model_path), dtype=dtype, trust_remote_code=self.trust_remote_code
        )
        model.to(torch_device)  # type: ignore[arg-type]  # transformers' stubs miss the device overload
        model.eval()
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [tokenizer.eos_token_id])
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
        counters = stats.endpoint(f"local:{device}")

        active: list[ConversationJob] = []
        exhausted = False
        while True:
            while len(active) < self.options.batch_size and not exhausted:
                job = next(jobs, None)
                if job is None:
                    exhausted = True
                else:
                    active.append(job)
            if not active:
                return
            prompts, batch = [], []
            for job in active:
                try:
                    prompts.append(renderer.render(job))
                    batch.append(job)
                except Exception as exc:  # jinja raises many types; the template is the user's
                    template_failure(job, exc)
            if batch:
                for job, generated in zip(batch, self._generate(model, tokenizer, prompts, eos_ids, pad_id)):
                    counters["requests"] += 1
                    counters["generated_tokens"] += generated.completion_tokens
                    job.accept(generated)
            still = []
            for job in active:
                if job.done:
                    counters["conversations"] += 1
                    finished(job)
                else:
                    still.append(job)
            active = still

    def _generate(self, model, tokenizer, prompts: list[str], eos_ids: set[int], pad_id: int) -> list[Generated]:
        import torch

        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = {k: v.to(model.device) for k, v in encoded.items()}
        options = self.options
        sampling: dict[str, Any] = {"do_sample": False}
        if options.temperature > 0:
            sampling = {"do_sample": True, "temperature": options.temperature, "top_p": options.top_p, "top_k": 0}
            if options.seed is not None:
                torch.manual_seed(options.seed)
        else:
            sampling.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            output = model.generate(
                **encoded,
                max_new_tokens=options.max_tokens,
                pad_token_id=pad_id,
                eos_token_id=sorted(eos_ids),
                **sampling,
            )
        new = output[:, encoded["input_ids"].shape[1] :].tolist()
        results = []
        for prompt, tokens in zip(prompts, new):
            cut = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
            finish = "stop" if cut is not None else "length"
            kept = tokens if cut is None else tokens[:cut]
            text = tokenizer.decode(kept, skip_special_tokens=True)
            reasoning, content = split_reasoning(text, opens_think(prompt))
            results.append(
                Generated(
                    content=content,
                    reasoning_content=reasoning or None,
                    finish_reason=finish,
                    completion_tokens=len(kept) + (cut is not None),
                )
            )
        return results
