"""Strategy tuples, device matrices, `Layout`, the fine mesh and strategy → `NamedSharding`."""

from jshard.layouts._dataset import DatasetStrategy as DatasetStrategy
from jshard.layouts._dataset import check_batch_rows as check_batch_rows
from jshard.layouts._dataset import check_dataset_strategy as check_dataset_strategy
from jshard.layouts._dataset import dataset_slots as dataset_slots
from jshard.layouts._device_matrix import ConvDims as ConvDims
from jshard.layouts._device_matrix import DotDims as DotDims
from jshard.layouts._device_matrix import broadcast_layouts as broadcast_layouts
from jshard.layouts._device_matrix import check_layouts_broadcast as check_layouts_broadcast
from jshard.layouts._device_matrix import check_layouts_product as check_layouts_product
from jshard.layouts._device_matrix import conv_layouts as conv_layouts
from jshard.layouts._device_matrix import dot_layouts as dot_layouts
from jshard.layouts._device_matrix import gather_layouts as gather_layouts
from jshard.layouts._device_matrix import scatter_layouts as scatter_layouts
from jshard.layouts._layout import Layout as Layout
from jshard.layouts._mesh import FineMesh as FineMesh
from jshard.layouts._mesh import NotRefined as NotRefined
from jshard.layouts._mesh import axis_names as axis_names
from jshard.layouts._mesh import named_sharding as named_sharding
from jshard.layouts._place import on_auto_axes as on_auto_axes
from jshard.layouts._place import place as place
from jshard.layouts._slots import Slot as Slot
from jshard.layouts._slots import canonicalize_slot as canonicalize_slot
from jshard.layouts._slots import canonicalize_slots as canonicalize_slots
from jshard.layouts._slots import layout_of as layout_of
from jshard.layouts._spec import Spec as Spec
from jshard.layouts._spec import constraint_spec as constraint_spec
from jshard.layouts._spec import replicated as replicated
from jshard.layouts._spec import slices as slices
from jshard.layouts._spec import spec_from_pspec as spec_from_pspec
from jshard.layouts._spec import to_pspec as to_pspec
from jshard.layouts._spec import typed_spec as typed_spec
from jshard.layouts._strategy import Strategy as Strategy
from jshard.layouts._strategy import TensorLayout as TensorLayout
from jshard.layouts._strategy import canonicalize_strategy as canonicalize_strategy
from jshard.layouts._strategy import check_divides as check_divides
from jshard.layouts._strategy import (
    with_repeated_calculation as with_repeated_calculation,
)
from jshard.layouts._tree import canonicalize_in_strategy as canonicalize_in_strategy
from jshard.layouts._tree import (
    canonicalize_strategy_tree as canonicalize_strategy_tree,
)
