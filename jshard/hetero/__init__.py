"""Host and device together: operators run on the host (`on_host`), state kept in host memory
between steps (`parallelize(..., offload=...)`: `Offload`, `streamed`) and activations kept there
between the forward and the backward pass (`offload_names`, `recompute(policy="offload")`), and
embedding tables that live, are read and are updated on the host (`HostTable`, `host_table`,
`lookup`, `sparse_update` with SGD, lazy Adam or Adagrad, `TABLE_OPTIMIZERS`: MindSpore's
parameter server, synchronous)."""

from jshard.hetero._host import HOST_COMPUTE as HOST_COMPUTE
from jshard.hetero._host import host_operators as host_operators
from jshard.hetero._host import on_host as on_host
from jshard.hetero._offload import HOST_MEMORY as HOST_MEMORY
from jshard.hetero._offload import HOST_POLICIES as HOST_POLICIES
from jshard.hetero._offload import OFFLOADABLE as OFFLOADABLE
from jshard.hetero._offload import Offload as Offload
from jshard.hetero._offload import check_offload as check_offload
from jshard.hetero._offload import offload_names as offload_names
from jshard.hetero._offload import offload_report as offload_report
from jshard.hetero._offload import on_host_shardings as on_host_shardings
from jshard.hetero._offload import streamed as streamed
from jshard.hetero._table import TABLE_OPTIMIZERS as TABLE_OPTIMIZERS
from jshard.hetero._table import HostTable as HostTable
from jshard.hetero._table import check_fits as check_fits
from jshard.hetero._table import host_table as host_table
from jshard.hetero._table import lookup as lookup
from jshard.hetero._table import sparse_update as sparse_update
from jshard.hetero._table import table_sharding as table_sharding
