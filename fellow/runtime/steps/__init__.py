"""The decode step's interface: the ``DecodeStep`` protocol every form implements and the ``StepTable`` that
tries them in order (``protocol``, ``table``). The forms themselves live with the model code they run
(``fellow.runtime.model``: the eager forms in ``eager_steps``, inductor's graphs in ``compiled``, the C step in
``native_step``, CUDA-graph replay in ``cuda_graphs``), and ``model.plan_steps`` is the one place that picks
them at load. Below ``model`` in the runtime's layers: nothing here imports a model module."""
