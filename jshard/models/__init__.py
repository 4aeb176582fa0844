"""Reference models (MLP, GPT with an optional scanned stack, ResNet, mixture of experts) and
their expert strategy presets (data, tensor, 2-D)."""

from jshard.models._gpt import GPT_RULES as GPT_RULES
from jshard.models._gpt import GPTConfig as GPTConfig
from jshard.models._gpt import copy_task_batch as copy_task_batch
from jshard.models._gpt import gpt_apply as gpt_apply
from jshard.models._gpt import gpt_loss as gpt_loss
from jshard.models._gpt import gpt_pipeline as gpt_pipeline
from jshard.models._gpt import gpt_split_problems as gpt_split_problems
from jshard.models._gpt import init_gpt as init_gpt
from jshard.models._mlp import MLP_RULES as MLP_RULES
from jshard.models._mlp import MLPConfig as MLPConfig
from jshard.models._mlp import init_mlp as init_mlp
from jshard.models._mlp import mlp_apply as mlp_apply
from jshard.models._mlp import mlp_batch as mlp_batch
from jshard.models._mlp import mlp_loss as mlp_loss
from jshard.models._moe import MOE_RULES as MOE_RULES
from jshard.models._moe import MoEConfig as MoEConfig
from jshard.models._moe import init_moe as init_moe
from jshard.models._moe import moe_apply as moe_apply
from jshard.models._moe import moe_batch as moe_batch
from jshard.models._moe import moe_loss as moe_loss
from jshard.models._presets import PRESETS as PRESETS
from jshard.models._presets import Preset as Preset
from jshard.models._presets import preset as preset
from jshard.models._resnet import RESNET_RULES as RESNET_RULES
from jshard.models._resnet import ResNetConfig as ResNetConfig
from jshard.models._resnet import init_resnet as init_resnet
from jshard.models._resnet import resnet_apply as resnet_apply
from jshard.models._resnet import resnet_batch as resnet_batch
from jshard.models._resnet import resnet_loss as resnet_loss
from jshard.models._train import make_train_step as make_train_step
from jshard.models._train import parallel_train_step as parallel_train_step
from jshard.models._train import state_strategies as state_strategies
