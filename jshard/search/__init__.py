"""Strategy search (`mode="auto"`): a strategy for every operator, by recursive bisection of the
mesh or by an ILP (HiGHS), both over one `SearchGraph` and one solver contract (`Solved`)."""

from jshard.search._search import SEARCHES as SEARCHES
from jshard.search._search import SearchReport as SearchReport
from jshard.search._search import Weighed as Weighed
from jshard.search._search import finest_cut as finest_cut
from jshard.search._search import search as search
