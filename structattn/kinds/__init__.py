"""Support kinds: the sets of parents a prior allows (``Support``) and the operators that
lower them (``Operator``). A new kind is a ``Support`` subclass stating ``contains`` — it then
works in every reading through the dense operator — and, for speed, an ``Operator`` subclass
it names as ``operator``."""

from .base import Intersection as Intersection
from .base import Operator as Operator
from .base import Support as Support
from .base import Union as Union
from .base import grid as grid
from .dense import AllParents as AllParents
from .dense import Before as Before
from .dense import Causal as Causal
from .dense import DenseOperator as DenseOperator
from .dense import Mask as Mask
from .edge_list import EdgeList as EdgeList
from .edge_list import EdgeListOperator as EdgeListOperator
from .stick_breaking import StickBreakingOperator as StickBreakingOperator
from .window import Window as Window
from .window import WindowOperator as WindowOperator
