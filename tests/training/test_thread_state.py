"""tf_nvlink's one thread-local (tf_nvlink.training.thread_state): set for a block, put back after it, per thread."""

import threading

from tf_nvlink.training import thread_state


def test_setting_puts_the_earlier_values_back_even_on_error():
    with thread_state.setting(loss_share=0.5, steps_asked=3):
        with thread_state.setting(loss_share=0.25):
            assert (thread_state.current().loss_share, thread_state.current().steps_asked) == (0.25, 3)
        assert thread_state.current().loss_share == 0.5
        try:
            with thread_state.setting(steps_asked=1):
                raise KeyError("inside")
        except KeyError:
            pass
        assert thread_state.current().steps_asked == 3
    assert (thread_state.current().loss_share, thread_state.current().steps_asked) == (None, None)


def test_each_thread_sees_its_own_state():
    seen = []
    with thread_state.setting(optimizer_mode="catch"):
        other = threading.Thread(target=lambda: seen.append(thread_state.current().optimizer_mode))
        other.start()
        other.join()
        assert thread_state.current().optimizer_mode == "catch"
    assert seen == [None]
