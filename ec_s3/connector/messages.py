"""Messages between the scheduler-role and worker-role parts (one engine step each).

vLLM pickles connector metadata from the scheduler to every worker each step, and
worker metadata back (merged across workers with ``aggregate``), so these are small
plain dataclasses. Owns their fields; does not own what either side does with them.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

__all__ = ["ECS3ConnectorMetadata", "ECS3WorkerMetadata", "LoadSpec"]


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """A staged, validated blob a worker must put into its encoder cache this step."""

    identifier: str
    key: str  # for workers on another host, which fetch from S3 themselves
    path: str  # staging file on the scheduler's host
    data_offset: int
    nbytes: int  # whole blob
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    host: str  # host_id() of the scheduler that staged it
    # The scheduler's open descriptor of the file (/proc/<pid>/fd/<n>, "" if none) and
    # the file's (st_dev, st_ino): read through it when the path no longer leads there.
    handle: str = ""
    inode: tuple[int, int] = (0, 0)
    # Where the item sits in the step's encoder inputs, should the worker have to
    # encode it after all (see ECS3ConnectorMetadata.encoder_inputs).
    request_id: str = ""
    input_index: int = -1
    has_media: bool = False  # the worker holds the item's media and can encode it


@dataclasses.dataclass
class ECS3ConnectorMetadata(ECConnectorMetadata):
    # Consumer: items to load into the encoder cache before the embeddings are gathered.
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    # Producer: key to publish each encoder output of this step's requests under.
    save_keys: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # Producer: identifier -> its placeholder metadata as the object metadata to store
    # with the blob (blob.format.PLACEHOLDER_METADATA_KEY), for items that have some.
    save_metadata: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    # Consumer: the step's ``scheduler_output.scheduled_encoder_inputs`` itself (the
    # same object: vLLM pickles the scheduler output with this metadata in it as one
    # object graph, which keeps shared references shared). vLLM runs the encoder on it
    # after ``start_load_caches``, so a worker that cannot load a blob it was promised
    # adds the item here and vLLM encodes it in the same step, instead of stopping the
    # engine on an encoder cache miss.
    encoder_inputs: dict[str, list[int]] | None = None
    # The number of a step whose worker counters the scheduler waits for (uploads
    # queued, blobs loaded; 0: none): the worker marks it in its stats snapshot
    # (ec_s3.connector.settle).
    watch: int = 0


@dataclasses.dataclass
class ECS3WorkerMetadata(ECConnectorWorkerMetadata):
    # Identifiers whose staged blob a worker could not use; the scheduler stops
    # trusting those slots.
    failed_loads: set[str] = dataclasses.field(default_factory=set)
    # host_id() of the reporting workers: sent with a worker's first metadata and with
    # any failure, so the scheduler learns whether workers can read its staging.
    hosts: set[str] = dataclasses.field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if isinstance(other, ECS3WorkerMetadata):
            return ECS3WorkerMetadata(
                failed_loads=self.failed_loads | other.failed_loads, hosts=self.hosts | other.hosts
            )
        return self
