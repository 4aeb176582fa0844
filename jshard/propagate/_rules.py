"""Every rule family, imported for its registrations into `_factors.RULES`."""

from jshard.propagate import _rules_control as _rules_control
from jshard.propagate import _rules_conv as _rules_conv
from jshard.propagate import _rules_dot as _rules_dot
from jshard.propagate import _rules_elementwise as _rules_elementwise
from jshard.propagate import _rules_gather as _rules_gather
from jshard.propagate import _rules_misc as _rules_misc
from jshard.propagate import _rules_reduce as _rules_reduce
from jshard.propagate import _rules_shape as _rules_shape
from jshard.propagate import _rules_window as _rules_window
