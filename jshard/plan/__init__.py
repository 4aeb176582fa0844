"""`Plan`: the typed record of what jshard decided for every operator (`OpRecord`), how it explains
a choice, and its JSON form (MindSpore's strategy checkpoint)."""

from jshard.plan._communication import CommunicationReport as CommunicationReport
from jshard.plan._io import to_json as to_json
from jshard.plan._offload import HOST_MEMORY as HOST_MEMORY
from jshard.plan._offload import OffloadReport as OffloadReport
from jshard.plan._optimizer import OptimizerReport as OptimizerReport
from jshard.plan._peer import PeerReport as PeerReport
from jshard.plan._plan import Later as Later
from jshard.plan._plan import Plan as Plan
from jshard.plan._plan import load as load
from jshard.plan._recompute import RecomputeReport as RecomputeReport
from jshard.plan._recompute import planned_peak as planned_peak
from jshard.plan._recompute import recompute_report as recompute_report
from jshard.plan._records import ORIGINS as ORIGINS
from jshard.plan._records import OpLayout as OpLayout
from jshard.plan._records import OpRecord as OpRecord
from jshard.plan._records import build_ops as build_ops
from jshard.plan._records import numbered as numbered
from jshard.plan._records import source_str as source_str
from jshard.plan._slices import RankSlices as RankSlices
from jshard.plan._work import REPLICATED_SHARE as REPLICATED_SHARE
from jshard.plan._work import WorkReport as WorkReport
