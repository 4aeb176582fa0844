"""What each primitive allows: sharding rules as factors, one registry (`RULES`) they all write to.

The contract a rule keeps (written where rules register, in `_factors.py`): a rule takes a jaxpr
equation and returns its `Factors` (every operand dim as a product of factors; dims sharing a
factor are cut alike; `reduced` factors leave partial sums); it never looks at a mesh. One family
per module: dot, elementwise, reduce, shape ops, gather/scatter, conv, window, control flow, PRNG
keys, batched linear algebra and FFT, cuDNN's fused attention, misc. `FALLBACKS` names the
primitives no rule covers and why. Importing this package registers every family.
"""

from jshard.rules import _attention as _attention  # noqa: F401  (each family registers its rules on import)
from jshard.rules import _control as _control  # noqa: F401
from jshard.rules import _conv as _conv  # noqa: F401
from jshard.rules import _dot as _dot  # noqa: F401
from jshard.rules import _elementwise as _elementwise  # noqa: F401
from jshard.rules import _gather as _gather  # noqa: F401
from jshard.rules import _linalg as _linalg  # noqa: F401
from jshard.rules import _misc as _misc  # noqa: F401
from jshard.rules import _random as _random  # noqa: F401
from jshard.rules import _reduce as _reduce  # noqa: F401
from jshard.rules import _shape as _shape  # noqa: F401
from jshard.rules import _window as _window  # noqa: F401
from jshard.rules._elementwise import ELEMENTWISE as ELEMENTWISE
from jshard.rules._factors import RULES as RULES
from jshard.rules._factors import Assignment as Assignment
from jshard.rules._factors import Factors as Factors
from jshard.rules._factors import expressible as expressible
from jshard.rules._factors import read_assignment as read_assignment
from jshard.rules._factors import rule as rule
from jshard.rules._factors import shape_of as shape_of
from jshard.rules._factors import whole as whole
from jshard.rules._factors import write_spec as write_spec
from jshard.rules._fallbacks import FALLBACKS as FALLBACKS
from jshard.rules._misc import PER_DEVICE as PER_DEVICE
from jshard.rules._table import OpTable as OpTable
from jshard.rules._table import neighbours_of as neighbours_of
from jshard.rules._traffic import FUSION as FUSION
from jshard.rules._traffic import MATMUL as MATMUL
