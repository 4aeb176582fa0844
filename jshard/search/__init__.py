"""Strategy search (`mode="auto"`): a strategy for every operator, by recursive bisection of the
mesh or by an ILP (HiGHS), both over one `SearchGraph` and one solver contract (`Solved`)."""

from jshard.search._graph import REPLICATED_SHARE as REPLICATED_SHARE
from jshard.search._regions import RegionChoice as RegionChoice
from jshard.search._regions import RegionCost as RegionCost
from jshard.search._regions import assignment as assignment
from jshard.search._regions import choices as choices
from jshard.search._regions import estimate as estimate
from jshard.search._regions import finest_cut as finest_cut
from jshard.search._regions import region_costs as region_costs
from jshard.search._regions import upgrades as upgrades
from jshard.search._search import SEARCHES as SEARCHES
from jshard.search._search import SearchReport as SearchReport
from jshard.search._search import Weighed as Weighed
from jshard.search._search import search as search
from jshard.search._seeded import DATA_PARALLEL as DATA_PARALLEL
from jshard.search._seeded import FULLY_SHARDED as FULLY_SHARDED
from jshard.search._seeded import PROPAGATED as PROPAGATED
from jshard.search._seeded import SEEDS as SEEDS
from jshard.search._seeded import Memo as Memo
from jshard.search._units import unit_components as unit_components
