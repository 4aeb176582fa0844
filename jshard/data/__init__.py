"""Dataset sharding over processes: global arrays from per-process data, MindSpore's
`dataset_strategy` forms, and a loader whose processes read only their own rows."""

from jshard.data._batch import DatasetStrategy as DatasetStrategy
from jshard.data._batch import ShardedLoader as ShardedLoader
from jshard.data._batch import batch_shardings as batch_shardings
from jshard.data._batch import local_slices as local_slices
from jshard.data._batch import shard_batch as shard_batch
