"""What the worker gives its engine, in the engine's types: the EngineConfig of the Settings, and
the GenerationRequest of a job request the contract checked (tasks/request.py). Nothing is checked
again here or in the engine, which refuses only what needs the model (the prompt in tokens against
the context and the KV budget, token ids against the vocabulary, a grammar that does not compile).
The web side never imports this: Settings and the contract know nothing of the engine."""

from __future__ import annotations

from dataclasses import fields

from weightq.batcher import BatcherConfig
from weightq.engine import EngineConfig, GenerationRequest, SamplingParams
from weightq.settings import BatcherSettings, EngineSettings, ServedSettings
from weightq.tasks.request import JobRequest


def engine_config(served: ServedSettings, engine: EngineSettings, batcher: BatcherSettings) -> EngineConfig:
    """The engine's config from its three groups: each setting goes, under its name and with its
    default, to the one config that declares it (the batcher's options, MAX_TOTAL_TOKENS among them,
    to `EngineConfig.batcher`)."""
    groups = (served, engine, batcher)
    return EngineConfig(
        **{k: v for g in groups for k, v in g.model_dump(include=ENGINE_FIELDS).items()},
        batcher=BatcherConfig(**{k: v for g in groups for k, v in g.model_dump(include=BATCHER_FIELDS).items()}),
    )


# The settings that reach the engine, by the config that declares them (SERVED_MODEL_NAME, ENGINE_PROCESS and
# LORA_ROOT/LORA_HUB_IDS stay with the worker; tests/app/test_settings.py checks that nothing else is left out).
ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"batcher"}
BATCHER_FIELDS = frozenset(f.name for f in fields(BatcherConfig))


# Every SamplingParams field but `guided` has a JobRequest field of the same name and meaning.
SAME_NAMES = tuple(f.name for f in fields(SamplingParams) if f.name != "guided")


def engine_request(
    job_id: str, job: JobRequest, *, shared_prefix_cache: bool = False, submitted_s: float | None = None
) -> GenerationRequest:
    """The engine's request for a job. Its tenant, the one the gateway authenticated, is the one the
    batcher shares service by (batcher/fairness.py); its prefix-cache keys are salted with it too, so
    one tenant can neither reuse another's KV nor learn from `cached_tokens` what another sent, unless
    the worker shares the cache across tenants (PREFIX_CACHE_SHARED). `submitted_s` (the job's submission,
    unix s) is its place in its class: submission order, whatever order task threads reach the engine in."""
    guided = (job.guided.kind, job.guided.spec) if job.guided is not None else None
    params = SamplingParams(**{name: getattr(job, name) for name in SAME_NAMES}, guided=guided)
    ids = list(job.prompt_token_ids) if job.prompt_token_ids is not None else None
    chat = [{"role": m.role, "content": m.content} for m in job.messages] if job.messages is not None else None
    salt = "" if shared_prefix_cache else job.tenant
    return GenerationRequest(
        job_id,
        job.prompt,
        ids,
        params,
        chat,
        job.priority,
        tenant=job.tenant,
        adapter=job.adapter,
        cache_salt=salt,
        deadline=job.deadline,
        submitted_s=submitted_s,
    )
