"""Pins of the TensorFlow internals tf_nvlink.internals.tf_runtime relies on (TensorFlow 2.21)."""

import inspect


def test_merge_call_switch_workers_and_xla_context():
    import tensorflow as tf
    from tensorflow.python.distribute import mirrored_strategy
    from tensorflow.python.ops import control_flow_util

    from tf_nvlink.internals import tf_runtime

    assert hasattr(mirrored_strategy.MirroredExtended, "_use_merge_call")
    assert hasattr(control_flow_util, "GraphOrParentsInXlaContext")
    assert tf_runtime.worker_count(tf.distribute.get_strategy()) == 1
    assert not tf_runtime.in_xla_context()

    @tf.function(jit_compile=True)
    def inside():
        return tf.constant(tf_runtime.in_xla_context())

    assert bool(inside())
    jit = tf_runtime.jit_tf_function(inside)
    assert jit is not None and jit[0] is inside and jit[2] is True
    assert tf_runtime.jit_tf_function(tf.function(lambda: 1)) is None


def test_profiler_trace_format_and_kernels():
    from tensorflow.python.eager import context

    from tf_nvlink.internals import tf_runtime

    assert {"XSpace", "XPlane", "XLine", "XEvent"} <= set(dir(tf_runtime.xplane_protobuf_module()))
    hlo = tf_runtime.hlo_protobuf_module()
    assert {"HloProto", "HloModuleProto", "HloInstructionProto", "HloScheduleProto"} <= set(dir(hlo))
    instruction = hlo.HloInstructionProto.DESCRIPTOR.fields_by_name
    assert {"name", "opcode", "metadata", "custom_call_target", "called_computation_ids", "id"} <= set(instruction)
    assert "op_name" in instruction["metadata"].message_type.fields_by_name  # xla.OpMetadata
    assert "sequences" in hlo.HloScheduleProto.DESCRIPTOR.fields_by_name
    assert "def set_config_key_value" in inspect.getsource(context.Context)


def test_step_trace_is_a_root_train_event_with_its_step():
    """TensorFlow's Trace passes its keyword arguments to TraceMe as metadata (`train#step_num=5,_r=1#`), which the
    profile plugin reads as a root step marker."""
    import tensorflow as tf

    from tf_nvlink.internals import tf_runtime

    assert "**kwargs" in str(inspect.signature(tf.profiler.experimental.Trace.__init__))
    with tf_runtime.step_trace(5):  # without a profiler running it records nothing and costs nothing
        pass
