"""Reference models (MLP, GPT) and their expert strategy presets (data, tensor, 2-D)."""

from jshard.models._gpt import GPT_RULES as GPT_RULES
from jshard.models._gpt import GPTConfig as GPTConfig
from jshard.models._gpt import copy_task_batch as copy_task_batch
from jshard.models._gpt import gpt_apply as gpt_apply
from jshard.models._gpt import gpt_loss as gpt_loss
from jshard.models._gpt import init_gpt as init_gpt
from jshard.models._mlp import MLP_RULES as MLP_RULES
from jshard.models._mlp import MLPConfig as MLPConfig
from jshard.models._mlp import init_mlp as init_mlp
from jshard.models._mlp import mlp_apply as mlp_apply
from jshard.models._mlp import mlp_batch as mlp_batch
from jshard.models._mlp import mlp_loss as mlp_loss
from jshard.models._presets import PRESETS as PRESETS
from jshard.models._presets import Preset as Preset
from jshard.models._presets import preset as preset
from jshard.models._train import make_train_step as make_train_step
from jshard.models._train import parallel_train_step as parallel_train_step
from jshard.models._train import state_strategies as state_strategies
