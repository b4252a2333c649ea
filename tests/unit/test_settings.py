import pytest

from inferq.settings import Settings, SettingsError, load_settings, parse_size


def test_parse_size_units():
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MB") == 512 * 1000**2
    assert parse_size("1048576") == 1048576
    with pytest.raises(ValueError):
        parse_size("lots")


def test_env_overrides_defaults(monkeypatch):
    monkeypatch.setenv("INFERQ_BLOCK_SIZE", "32")
    monkeypatch.setenv("INFERQ_KV_CACHE_MEMORY", "256MiB")
    s = Settings()
    assert s.block_size == 32
    assert s.kv_cache_bytes == 256 * 1024**2


def test_toml_file_and_env_precedence(monkeypatch, tmp_path):
    cfg = tmp_path / "inferq.toml"
    cfg.write_text('max_num_seqs = 7\nblock_size = 8\nwebhook_allowlist = "10.0.0.0/8, hooks.local"\n')
    monkeypatch.setenv("INFERQ_CONFIG", str(cfg))
    monkeypatch.setenv("INFERQ_BLOCK_SIZE", "64")
    s = load_settings()
    assert s.max_num_seqs == 7
    assert s.block_size == 64  # environment beats the file
    assert s.allowlist == ["10.0.0.0/8", "hooks.local"]


def test_bad_settings_give_one_readable_error(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERQ_BLOCK_SIZE", "zero")
    with pytest.raises(SettingsError, match="block_size"):
        load_settings()
    monkeypatch.delenv("INFERQ_BLOCK_SIZE")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_num_seqs = [unclosed\n")
    monkeypatch.setenv("INFERQ_CONFIG", str(bad))
    with pytest.raises(SettingsError, match="bad.toml"):
        load_settings()
    monkeypatch.setenv("INFERQ_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings()
