"""pipedejavu.costmodel.analytical: per-layer costs from FLOPs and bytes, no
profiles needed (a roofline with fitted efficiency curves)."""

from pipedejavu.costmodel.analytical.layers import (
    activation_bytes as activation_bytes,
)
from pipedejavu.costmodel.analytical.layers import (
    analytical_layer_times as analytical_layer_times,
)
from pipedejavu.costmodel.analytical.layers import (
    attention_core_forward_seconds as attention_core_forward_seconds,
)
from pipedejavu.costmodel.analytical.layers import (
    block_forward_seconds as block_forward_seconds,
)
from pipedejavu.costmodel.analytical.layers import (
    layer_output_bytes as layer_output_bytes,
)
from pipedejavu.costmodel.analytical.ops import PassOptions as PassOptions
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL as FITTED_ANALYTICAL,
)
from pipedejavu.costmodel.analytical.roofline import (
    AnalyticalConstants as AnalyticalConstants,
)
