"""The stop board (backend/contract/stop_board.py): where the OpenAI frontend posts a request to end, and the models
read it. Its place follows from the server's gRPC port, so both ends find it without being told."""

from __future__ import annotations

from backend.contract.settings import STOP_BOARD_ENV_VAR
from backend.contract.stop_board import StopBoard


def test_a_post_is_read_until_it_is_withdrawn(tmp_path):
    board = StopBoard(tmp_path / "board").clear()
    assert board.posted() == frozenset()
    assert board.post("openai-0123abcd") and board.post("client.7")
    assert board.posted() == {"openai-0123abcd", "client.7"}
    board.withdraw("openai-0123abcd")
    board.withdraw("openai-0123abcd")  # twice, or never posted: nothing happens
    assert board.posted() == {"client.7"}


def test_an_id_that_is_no_plain_file_name_is_never_posted(tmp_path):
    board = StopBoard(tmp_path / "board").clear()
    for bad in ("", "../escape", "a/b", ".hidden", "x" * 129, "sp ace", "nul\\0"):
        assert not board.post(bad), bad
        board.withdraw(bad)
    assert board.posted() == frozenset() and not (tmp_path / "escape").exists()


def test_a_board_that_is_gone_reads_empty_and_refuses_posts(tmp_path):
    board = StopBoard(tmp_path / "board").clear()
    board.remove()
    assert board.posted() == frozenset() and not board.post("openai-1")  # the caller then cancels


def test_clearing_drops_the_posts_of_a_server_that_died(tmp_path):
    board = StopBoard(tmp_path / "board").clear()
    board.post("openai-1")
    assert board.clear().posted() == frozenset()


def test_the_launcher_and_a_frontend_on_this_host_find_the_same_board_by_the_grpc_port(tmp_path):
    env = {}
    board = StopBoard.for_port(18001, env)
    assert board.path.name == "llm-stop-board-18001"
    assert StopBoard.find("127.0.0.1:18001", env) is None  # no server made it yet
    board.clear()
    try:
        assert StopBoard.find("127.0.0.1:18001", env).path == board.path
        assert StopBoard.find("localhost:18001", env).path == board.path
        assert StopBoard.find("10.1.2.3:18001", env) is None  # a server elsewhere: its streams are cancelled
        assert StopBoard.find("triton:18001", env) is None
        assert StopBoard.find("no-port", env) is None
    finally:
        board.remove()


def test_the_environment_names_another_board_for_both_ends(tmp_path):
    env = {STOP_BOARD_ENV_VAR: str(tmp_path / "mine")}
    assert StopBoard.for_port(8001, env).path == tmp_path / "mine"
    assert StopBoard.from_env(env) is None  # not made yet
    StopBoard.for_port(8001, env).clear()
    assert StopBoard.from_env(env).path == tmp_path / "mine"
    assert StopBoard.find("127.0.0.1:8001", env).path == tmp_path / "mine"
