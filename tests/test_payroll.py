"""payrun.payroll: schema, deterministic seed, CSV import (all-or-nothing), snapshots."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from payrun import payroll as P
from payrun.errors import InputError

SAMPLE_CSV = Path(__file__).resolve().parent.parent / "docs" / "sample-employees.csv"
MONTH = "2026-11"


# ---- helpers ---------------------------------------------------------------

def open_db(tmp_path: Path, name: str = "payroll.db") -> P.PayrollDB:
    return P.PayrollDB(tmp_path / name)


def dump(db: P.PayrollDB) -> dict[str, list[tuple]]:
    return {
        t: db.conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall()
        for t in ("companies", "employees", "salary_lines")
    }


def counts(db: P.PayrollDB) -> tuple[int, int, int]:
    return tuple(  # type: ignore[return-value]
        db.conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("companies", "employees", "salary_lines")
    )


def sample_rows() -> tuple[list[str], list[dict[str, str]]]:
    with open(SAMPLE_CSV, encoding="utf-8", newline="") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames or []), list(r)


def write_csv(path: Path, header: list[str], rows: list[dict[str, str]]) -> Path:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=header, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    path.write_text(buf.getvalue(), encoding="utf-8")
    return path


@pytest.fixture
def seeded(tmp_path: Path) -> P.PayrollDB:
    db = open_db(tmp_path)
    P.seed(db, companies=12, employees=300, seed=7, month=MONTH)
    yield db
    db.close()


# ---- schema ----------------------------------------------------------------

def test_schema_modes_and_permissions(tmp_path: Path) -> None:
    path = tmp_path / "private" / "payroll.db"
    db = P.PayrollDB(path)
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert set(db.db.table_names()) >= {"companies", "employees", "salary_lines"}
    assert db.db["salary_lines"].pks == ["employee_id", "month"]
    db.close()
    with P.PayrollDB(path) as again:  # idempotent on an existing file
        assert counts(again) == (0, 0, 0)


def test_foreign_keys_enforced(tmp_path: Path) -> None:
    db = open_db(tmp_path)
    with pytest.raises(Exception, match="FOREIGN KEY"):
        db.db["employees"].insert({
            "id": "emp-1", "company_id": 99, "name_en": "x", "name_bn": "x", "email": "x@y.z",
            "department": "x", "designation": "x", "bank_account": "12345678"})


# ---- seed ------------------------------------------------------------------

def test_seed_is_deterministic(tmp_path: Path) -> None:
    a, b, c = (open_db(tmp_path, f"{n}.db") for n in "abc")
    P.seed(a, companies=12, employees=300, seed=7)
    P.seed(b, companies=12, employees=300, seed=7)
    P.seed(c, companies=12, employees=300, seed=8)
    assert dump(a) == dump(b)
    assert dump(a) != dump(c)
    before = dump(a)
    P.seed(a, companies=12, employees=300, seed=7)  # again: replaces with identical rows
    assert dump(a) == before
    assert counts(a) == (12, 300, 300)


def test_seed_another_month_keeps_people_and_pay(tmp_path: Path) -> None:
    db = open_db(tmp_path)
    P.seed(db, companies=5, employees=100, month="2026-11")
    emps = dump(db)["employees"]
    P.seed(db, companies=5, employees=100, month="2026-12")
    assert dump(db)["employees"] == emps
    basics = {
        m: db.conn.execute("SELECT employee_id, basic FROM salary_lines WHERE month = ? "
                           "ORDER BY 1", [m]).fetchall()
        for m in ("2026-11", "2026-12")
    }
    assert basics["2026-11"] == basics["2026-12"]


def test_seed_data_is_realistic(seeded: P.PayrollDB) -> None:
    db = seeded
    per_company = dict(db.conn.execute(
        "SELECT c.id, count(e.id) FROM companies c LEFT JOIN employees e "
        "ON e.company_id = c.id GROUP BY c.id").fetchall())
    assert len(per_company) == 12 and min(per_company.values()) >= 1
    assert len(set(per_company.values())) > 1  # uneven
    names_bn = {en: bn for en, bn in (P.MUSLIM_MALE + P.MUSLIM_FEMALE + P.HINDU_MALE
                                      + P.HINDU_FEMALE + P.MUSLIM_SURNAMES
                                      + P.MUSLIM_FEMALE_SURNAMES + P.HINDU_SURNAMES)}
    emails = set()
    for emp_id, en, bn, email, bank in db.conn.execute(
            "SELECT id, name_en, name_bn, email, bank_account FROM employees"):
        assert re.fullmatch(r"emp-\d{5}", emp_id)
        first, last = en.split(" ")
        assert bn == f"{names_bn[first]} {names_bn[last]}"
        n = int(emp_id[4:])
        assert re.fullmatch(rf"{first.lower()}\.{last.lower()}\.{n}@[a-z0-9-]+\.example", email)
        assert re.fullmatch(r"\d{13}", bank)
        emails.add(email)
    assert len(emails) == 300
    for c in P.companies(db):
        assert re.search(r", (Dhaka|Chattogram) \d{4}$", c["address"]), c


def test_seed_amounts_and_net_positive(tmp_path: Path) -> None:
    db = open_db(tmp_path)
    for s, month in ((1, "2026-11"), (2, "2026-03"), (3, "2027-05")):
        P.seed(db, companies=8, employees=400, seed=s, month=month, reset=True)
        rows = db.conn.execute(f"SELECT {', '.join(P.AMOUNT_FIELDS)} FROM salary_lines "
                               "WHERE month = ?", [month]).fetchall()
        assert len(rows) == 400
        for r in rows:
            a = dict(zip(P.AMOUNT_FIELDS, r))
            assert all(isinstance(v, int) and v >= 0 for v in a.values())
            assert 15_000_00 <= a["basic"] <= 250_000_00 and a["basic"] % 100 == 0
            assert a["house_rent"] * 2 == a["basic"]
            assert a["medical"] * 10 == a["basic"] == a["provident_fund"] * 10
            gross = sum(a[k] for k in P.EARNINGS)
            assert gross - sum(a[k] for k in P.DEDUCTIONS) > 0
            if month in P.EID_MONTHS:
                assert a["bonus"] == a["basic"]


def test_seed_progress_and_reset(tmp_path: Path) -> None:
    db = open_db(tmp_path)
    calls: list[tuple[int, int]] = []
    P.seed(db, companies=3, employees=120, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (120, 120)
    P.seed(db, companies=2, employees=10, reset=True)
    assert counts(db) == (2, 10, 10)
    with pytest.raises(InputError, match="YYYY-MM"):
        P.seed(db, month="2026-13")


def test_ensure_month(seeded: P.PayrollDB, tmp_path: Path) -> None:
    db = seeded
    assert P.ensure_month(db, MONTH) == 0
    assert P.ensure_month(db, "2026-12") == 300
    assert P.ensure_month(db, "2026-12") == 0
    assert P.count_employees(db, "2026-12") == 300
    assert db.conn.execute(
        "SELECT sum(bonus) FROM salary_lines WHERE month = '2026-12'").fetchone()[0] == 0
    assert db.conn.execute(
        "SELECT count(*) FROM salary_lines a JOIN salary_lines b ON a.employee_id = "
        "b.employee_id AND a.month = '2026-11' AND b.month = '2026-12' AND a.basic = b.basic "
        "AND a.loan = b.loan").fetchone()[0] == 300
    # with a seed, an Eid month gets its festival bonus
    assert P.ensure_month(db, "2027-03", seed=7) == 300
    assert db.conn.execute("SELECT count(*) FROM salary_lines WHERE month = '2027-03' "
                           "AND bonus = basic").fetchone()[0] == 300
    with open_db(tmp_path, "empty.db") as empty:
        assert P.ensure_month(empty, MONTH) == 0


# ---- snapshots -------------------------------------------------------------

def test_snapshot_shape_matches_architecture_doc(seeded: P.PayrollDB) -> None:
    db = seeded
    full_accounts = [r[0] for r in db.conn.execute("SELECT bank_account FROM employees")]
    snaps = list(P.snapshots(db, MONTH))
    assert len(snaps) == 300 == P.count_employees(db, MONTH)
    for s in snaps:
        assert list(s) == ["month", "key", "company", "employee", "earnings", "deductions"]
        assert s["month"] == MONTH
        assert s["key"] == f"slip:{MONTH}:{s['employee']['id']}"
        assert set(s["company"]) == {"id", "name", "address"}
        assert isinstance(s["company"]["id"], int)
        assert all(isinstance(s["company"][k], str) and s["company"][k] for k in ("name", "address"))
        assert set(s["employee"]) == {"id", "name_en", "name_bn", "email", "department",
                                      "designation", "bank_account"}
        assert all(isinstance(v, str) and v for v in s["employee"].values())
        assert re.fullmatch(r"•••• \d{4}", s["employee"]["bank_account"])
        assert list(s["earnings"]) == ["basic", "house_rent", "medical", "conveyance", "bonus"]
        assert list(s["deductions"]) == ["tax", "provident_fund", "loan"]
        for v in (*s["earnings"].values(), *s["deductions"].values()):
            assert type(v) is int
        text = json.dumps(s, ensure_ascii=False)
        assert json.loads(text) == s
    blob = json.dumps(snaps, ensure_ascii=False)
    for acct in full_accounts:
        assert acct not in blob
        assert acct[-8:] not in blob  # not even a longer tail
    order = [(s["company"]["id"], s["employee"]["id"]) for s in snaps]
    assert order == sorted(order)


def test_snapshot_filters_and_queries(seeded: P.PayrollDB) -> None:
    db = seeded
    cid = 3
    mine = list(P.snapshots(db, MONTH, company_id=cid))
    assert mine and all(s["company"]["id"] == cid for s in mine)
    assert len(mine) == P.count_employees(db, MONTH, company_id=cid)
    assert P.company_ids_for(db, MONTH) == list(range(1, 13))
    assert P.company_ids_for(db, MONTH, company_id=cid) == [cid]
    assert P.company_ids_for(db, "2027-01") == [] and P.count_employees(db, "2027-01") == 0
    assert [c["id"] for c in P.companies(db)] == list(range(1, 13))
    gone = mine[0]["employee"]["id"]
    db.db.execute("UPDATE employees SET active = 0 WHERE id = ?", [gone])
    assert gone not in {s["employee"]["id"] for s in P.snapshots(db, MONTH)}
    assert P.count_employees(db, MONTH) == 299
    # a one-off resend still finds an inactive employee
    one = P.employee_snapshot(db, MONTH, gone)
    assert one == mine[0]
    with pytest.raises(InputError, match="no salary line"):
        P.employee_snapshot(db, "2027-01", gone)
    with pytest.raises(InputError, match="no employee"):
        P.employee_snapshot(db, MONTH, "emp-99999")
    with pytest.raises(InputError, match="YYYY-MM"):
        list(P.snapshots(db, "11-2026"))


# ---- CSV import: happy path ------------------------------------------------

def test_import_sample_csv_on_seeded_db(seeded: P.PayrollDB) -> None:
    db = seeded
    res = P.import_csv(db, SAMPLE_CSV)
    assert res == P.ImportResult(companies=1, employees=12, salary_lines=12, new_lines=12, months=[MONTH],
                                 employee_ids=[f"emp-{90000 + i}" for i in range(1, 13)])
    assert counts(db) == (12, 312, 312)
    s = P.employee_snapshot(db, MONTH, "emp-90001")
    assert s["employee"]["name_bn"] == "তানভীর আহমেদ"
    assert s["employee"]["bank_account"] == "•••• 4821"
    assert s["earnings"]["basic"] == 4500000
    assert P.employee_snapshot(db, MONTH, "emp-90003")["deductions"]["tax"] == 745050
    assert P.employee_snapshot(db, MONTH, "emp-90012")["employee"]["designation"] == \
        "Manager, Accounts & Tax"
    # re-import is an upsert: same counts, and it says the twelve were there already
    again = P.import_csv(db, SAMPLE_CSV)
    assert (again.employees, again.salary_lines, len(again.existing_employees)) == (12, 12, 12)
    assert counts(db) == (12, 312, 312)


def test_import_updates_and_bom(seeded: P.PayrollDB, tmp_path: Path) -> None:
    db = seeded
    header, rows = sample_rows()
    rows[0]["basic"] = "46000.5"
    rows[0]["designation"] = "Chief Accountant"
    rows[1]["month"] = "2026-12"  # a second month for another employee
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbf" + write_csv(tmp_path / "x.csv", header, rows).read_bytes())
    P.import_csv(db, SAMPLE_CSV)
    P.import_csv(db, p)
    s = P.employee_snapshot(db, MONTH, "emp-90001")
    assert s["earnings"]["basic"] == 4600050
    assert s["employee"]["designation"] == "Chief Accountant"
    assert P.count_employees(db, "2026-12") == 1
    assert counts(db) == (12, 312, 313)


def test_import_companies_csv(tmp_path: Path) -> None:
    db = open_db(tmp_path)
    p = tmp_path / "c.csv"
    p.write_text("id,name,address\n1,Meghna Textiles Ltd,\"House 12, Road 4, Dhanmondi, "
                 "Dhaka 1205\"\n2,Padma Pharmaceuticals,\"Agrabad, Chattogram 4100\"\n",
                 encoding="utf-8")
    assert P.import_companies_csv(db, p) == P.ImportResult(companies=2)
    assert P.companies(db)[0]["address"] == "House 12, Road 4, Dhanmondi, Dhaka 1205"
    assert P.import_csv(db, SAMPLE_CSV).employees == 12  # company 1 now exists
    bad = tmp_path / "bad.csv"
    bad.write_text("id,name,address\n3,New Co,Dhaka\nx,Bad,Dhaka\n3,Dup,Dhaka\n4,,Dhaka\n",
                   encoding="utf-8")
    with pytest.raises(InputError) as e:
        P.import_companies_csv(db, bad)
    msg = str(e.value)
    assert "line 3: id 'x'" in msg and "line 4: duplicate of line 2" in msg
    assert "line 5: name is empty" in msg
    assert len(P.companies(db)) == 2
    # again, one company renamed: the import says which it replaced (walkthrough: it said
    # "imported 1 companies" and the old name was gone without a word)
    p.write_text("id,name,address\n1,Meghna Textiles PLC,\"House 12, Road 4, Dhanmondi, Dhaka 1205\"\n"
                 "2,Padma Pharmaceuticals,\"Agrabad, Chattogram 4100\"\n3,Jamuna Foods,Bogura\n", encoding="utf-8")
    assert P.import_companies_csv(db, p) == P.ImportResult(companies=3, updated=[1], unchanged=1)


# ---- CSV import: bad rows ---------------------------------------------------

BAD_ROWS = {
    "missing field": ({"email": ""}, "email is empty"),
    "missing name": ({"name_en": "  "}, "name_en is empty"),
    "malformed email": ({"email": "tanvir ahmed@x.example"}, "email 'tanvir ahmed@x.example' is not a valid address"),
    "email two @": ({"email": "a@b@c.example"}, "email 'a@b@c.example' is not a valid address"),
    "email no dot": ({"email": "a@localhost"}, "email 'a@localhost' is not a valid address"),
    "negative amount": ({"tax": "-350"}, "tax '-999' (digits shown as 9) is negative"),
    "three decimals": ({"basic": "45000.505"}, "basic '99999.999' (digits shown as 9) has more than 2 decimals"),
    "not a number": ({"loan": "5k"}, "loan '9k' (digits shown as 9) is not an amount"),
    "unknown company": ({"company_id": "999"}, "company_id 999 does not exist"),
    "bad month": ({"month": "2026-13"}, "month '2026-13' is not a valid YYYY-MM month"),
    "bad month format": ({"month": "11/2026"}, "month '11/2026' is not a valid YYYY-MM month"),
    "bad employee id": ({"employee_id": "E-17"}, "employee_id 'E-17' must be emp-"),
    "bank letters": ({"bank_account": "12345678AB"}, "bank_account must be 8 to 20 digits"),
    "bank short": ({"bank_account": "1234"}, "bank_account must be 8 to 20 digits"),
    "net negative": ({"loan": "999999"}, "deductions (tax, provident_fund, loan) exceed earnings (basic, house_rent, medical, conveyance, bonus): "
                     "the net pay would be negative"),
    "duplicate": ("dup", "duplicate of line 2 (emp-90001, 2026-11)"),
    "conflicting details": ("conflict", "emp-90001's details differ from line 2"),
}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_bad_last_row_is_reported_and_nothing_imported(
        kind: str, seeded: P.PayrollDB, tmp_path: Path) -> None:
    db = seeded
    header, rows = sample_rows()
    change, reason = BAD_ROWS[kind]
    last = dict(rows[-1])
    if change == "dup":
        last = dict(rows[0])
    elif change == "conflict":
        last = dict(rows[0], month="2026-12", name_en="Tanvir Ahmad")
    else:
        last.update(change)
    rows[-1] = last
    path = write_csv(tmp_path / "in.csv", header, rows)
    before = dump(db)
    with pytest.raises(InputError) as e:
        P.import_csv(db, path)
    msg = str(e.value)
    assert f"line 13: {reason}" in msg, msg
    assert "nothing imported" in msg
    assert "\n" not in msg  # the CLI prints errors as one line
    assert [line for line, _ in e.value.problems] == [13]  # type: ignore[attr-defined]
    assert dump(db) == before  # not even the 11 good rows


def test_all_bad_rows_listed_with_physical_line_numbers(seeded: P.PayrollDB,
                                                       tmp_path: Path) -> None:
    header, rows = sample_rows()
    rows[0]["name_en"] = "Tanvir\nAhmed"  # quoted newline: this row spans lines 2-3
    rows[2]["email"] = "nope"  # row 3 -> physical line 5
    rows[5]["month"] = "2026-00"  # row 6 -> line 8
    path = write_csv(tmp_path / "in.csv", header, rows)
    with pytest.raises(InputError) as e:
        P.import_csv(seeded, path)
    lines = [line for line, _ in e.value.problems]  # type: ignore[attr-defined]
    assert lines == [2, 5, 8]
    assert "line 2: name_en contains a control character" in str(e.value)
    assert "3 bad row(s)" in str(e.value)


@pytest.mark.parametrize("ch", ["\u2028", "\u2029", "\u202a", "\u202b", "\u202c", "\u202d", "\u202e",
                                "\u2066", "\u2067", "\u2068", "\u2069", "\u200e", "\u200f", "\u061c"])
def test_line_separators_and_bidi_controls_are_refused_with_their_line(seeded: P.PayrollDB, tmp_path: Path,
                                                                     ch: str) -> None:
    """Security review (session 39): U+2028/2029 and the bidi controls are not category Cc,
    so the control-character check let them through; each can make a name read otherwise
    on the slip, in a terminal or in a log ("Ahmed\u202edenied" shows "Ahmeddeined")."""
    header, rows = sample_rows()
    before = dump(seeded)
    rows[2]["name_en"] = f"Tanvir{ch}Ahmed"  # row 3 -> line 4
    rows[4]["department"] = f"Acc{ch}ounts"  # row 5 -> line 6
    path = write_csv(tmp_path / "in.csv", header, rows)
    with pytest.raises(InputError) as e:
        P.import_csv(seeded, path)
    assert [line for line, _ in e.value.problems] == [4, 6]  # type: ignore[attr-defined]
    msg = str(e.value)
    assert f"line 4: name_en contains U+{ord(ch):04X} (" in msg and "line 6: department contains" in msg
    assert ch not in msg  # the message names the character; it does not print it
    assert dump(seeded) == before
    bad = tmp_path / "companies.csv"
    bad.write_text(f"id,name,address\n7,New Co,Dhaka\n8,Evil{ch}Co,Dhaka\n9,Fine Co,\"Road 4{ch}, Dhaka\"\n",
                   encoding="utf-8")
    with pytest.raises(InputError) as e:
        P.import_companies_csv(seeded, bad)
    assert [line for line, _ in e.value.problems] == [3, 4]  # type: ignore[attr-defined]
    assert "line 3: name contains U+" in str(e.value) and "line 4: address contains U+" in str(e.value)
    assert dump(seeded) == before


def test_zero_width_joiner_and_non_joiner_stay_accepted(seeded: P.PayrollDB, tmp_path: Path) -> None:
    """Bengali script needs ZWJ/ZWNJ (র‍্যাব, ক্‌ষ): they are not bidi controls."""
    header, rows = sample_rows()
    rows[0]["name_bn"] = "র\u200d্যাব ক্\u200cষ"
    path = write_csv(tmp_path / "in.csv", header, rows)
    P.import_csv(seeded, path)
    got = seeded.conn.execute("SELECT name_bn FROM employees WHERE id = ?", (rows[0]["employee_id"],)).fetchone()[0]
    assert got == "র\u200d্যাব ক্\u200cষ"


def test_many_problems_are_capped_and_accounts_never_echoed(seeded: P.PayrollDB,
                                                           tmp_path: Path) -> None:
    header, rows = sample_rows()
    bad = []
    for i in range(80):
        r = dict(rows[0], employee_id=f"emp-{i:05d}", email=f"x{i}@x.example",
                 bank_account="98765432101234X", company_id=str(700 + i))
        bad.append(r)
    path = write_csv(tmp_path / "in.csv", header, bad)
    with pytest.raises(InputError) as e:
        P.import_csv(seeded, path)
    msg = str(e.value)
    assert len(e.value.problems) == 160  # type: ignore[attr-defined]
    # the same reason on every line is given once, with its lines; 80 companies, one each
    assert "lines 2, 3, 4 and 77 more: bank_account must be 8 to 20 digits" in msg
    assert msg.count("line ") == P.MAX_LISTED_PROBLEMS - 1  # (the grouped entry is one of the 50)
    assert "and 31 more" in msg
    assert "98765432101234" not in msg


def test_header_and_file_problems(seeded: P.PayrollDB, tmp_path: Path) -> None:
    p = tmp_path / "in.csv"
    p.write_text("company_id,employee_id,name_en,email,month,basic\n1,emp-1,A,a@b.c,2026-11,1\n",
                 encoding="utf-8")
    with pytest.raises(InputError, match="missing column") as e:
        P.import_csv(seeded, p)
    for col in ("name_bn", "department", "designation", "bank_account", "house_rent", "loan"):
        assert col in str(e.value)
    p.write_bytes(b"")
    with pytest.raises(InputError, match="empty"):
        P.import_csv(seeded, p)
    header, rows = sample_rows()
    write_csv(p, header, [])
    with pytest.raises(InputError, match="no data rows"):
        P.import_csv(seeded, p)
    p.write_bytes(SAMPLE_CSV.read_bytes().replace("তানভীর".encode(), b"\xff\xfe"))
    with pytest.raises(InputError, match="line 2: not UTF-8"):
        P.import_csv(seeded, p)
    with pytest.raises(InputError, match="cannot read"):
        P.import_csv(seeded, tmp_path / "missing.csv")
    p.write_text(",".join(header) + "\n1,2,3\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 2: has 3 fields, the header has 17"):
        P.import_csv(seeded, p)


def test_unquoted_thousands_separators_get_one_short_error_with_the_fix(seeded, tmp_path):
    """New-user walkthrough (session 35): a spreadsheet's "45,000" saved unquoted split each
    amount in two: one error of 1,762 characters, the same words for every line, and no
    hint. The reason is now given once, with its lines, and says what to do."""
    lines = SAMPLE_CSV.read_text(encoding="utf-8").splitlines()
    bad = [lines[0]] + [re.sub(r",(\d\d)(\d{3}),", r",\1,\2,", ln, count=1) for ln in lines[1:]]
    p = tmp_path / "thousands.csv"
    p.write_text("\n".join(bad) + "\n", encoding="utf-8")
    with pytest.raises(InputError) as e:
        P.import_csv(seeded, p)
    msg = str(e.value)
    n = len(lines) - 1
    assert f"{n} bad row(s), nothing imported: lines 2, 3, 4 and {n - 3} more: has 18 fields, the header has 17" in msg
    assert msg.count("thousands separator") == 1 and 'quote it: "45,000"' in msg
    assert len(msg) < 400, len(msg)
    assert len(e.value.problems) == n  # (callers still get every line)
    # a row with one field too many for another reason: no hint about amounts
    p = tmp_path / "extra.csv"
    p.write_text(lines[0] + "\n" + lines[1] + ",extra\n", encoding="utf-8")
    with pytest.raises(InputError) as e:
        P.import_csv(seeded, p)
    assert "line 2: has 18 fields, the header has 17" in str(e.value) and "separator" not in str(e.value)


# ---- property: never a partial import, never another exception type ---------

@pytest.fixture(scope="module")
def prop_db(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("prop")
    db = P.PayrollDB(d / "payroll.db")
    P.seed(db, companies=3, employees=20)
    yield d, db
    db.close()


def _assert_all_or_nothing(db: P.PayrollDB, path: Path) -> None:
    before = dump(db)
    try:
        res = P.import_csv(db, path)
    except InputError:
        assert dump(db) == before
        return
    # any other exception type fails the test; success means every row was written
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert res.salary_lines == len(rows)
    for r in rows:
        got = db.conn.execute("SELECT basic FROM salary_lines WHERE employee_id = ? AND "
                              "month = ?", [r["employee_id"], r["month"]]).fetchone()
        assert got == (P._parse_amount(r["basic"]),)


SLOW = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
text_no_surrogates = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)


@SLOW
@given(text_no_surrogates)
def test_garbage_text_raises_input_error(prop_db, text: str) -> None:
    d, db = prop_db
    p = d / "garbage.csv"
    p.write_text(text, encoding="utf-8")
    before = dump(db)
    with pytest.raises(InputError):
        P.import_csv(db, p)
    assert dump(db) == before


@SLOW
@given(st.binary(max_size=300))
def test_garbage_bytes_raise_input_error(prop_db, data: bytes) -> None:
    d, db = prop_db
    p = d / "garbage.bin"
    p.write_bytes(data)
    before = dump(db)
    with pytest.raises(InputError):
        P.import_csv(db, p)
    assert dump(db) == before


_GOOD = {
    "company_id": st.sampled_from(["1", "2", "3"]),
    "employee_id": st.integers(1, 40).map(lambda n: f"emp-{n:05d}"),
    "name_en": st.sampled_from(["Tanvir Ahmed", "Nusrat Akter"]),
    "name_bn": st.sampled_from(["তানভীর আহমেদ", "নুসরাত আক্তার"]),
    "email": st.sampled_from(["t.a@x.example", "n.a@y.example"]),
    "department": st.just("Finance"),
    "designation": st.just("Accountant"),
    "bank_account": st.just("1234567890123"),
    "month": st.sampled_from(["2026-11", "2026-12"]),
    **{f: st.sampled_from(["0", "100", "45000", "45000.50"])
       for f in P.AMOUNT_FIELDS if f in P.DEDUCTIONS},
    **{f: st.sampled_from(["45000", "120000.5", "99999.99"])
       for f in P.AMOUNT_FIELDS if f in P.EARNINGS},
}
_garbage_field = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def near_valid_csv(draw) -> str:
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        row = []
        for col in P.CSV_COLUMNS:
            bad = draw(st.integers(0, 20)) == 0
            row.append(draw(_garbage_field) if bad else draw(_GOOD[col]))
        rows.append(row)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator=draw(st.sampled_from(["\n", "\r\n"])))
    w.writerow(P.CSV_COLUMNS)
    w.writerows(rows)
    return buf.getvalue()


@SLOW
@given(near_valid_csv())
def test_near_valid_csv_is_all_or_nothing(prop_db, text: str) -> None:
    d, db = prop_db
    p = d / "near.csv"
    p.write_text(text, encoding="utf-8")
    _assert_all_or_nothing(db, p)


def test_import_refuses_what_the_slip_or_the_provider_would_refuse_later(seeded: P.PayrollDB,
                                                                        tmp_path: Path) -> None:
    """Text longer than the slip has room for, and addresses mail servers refuse (a dot
    first, last or twice in the local part), used to pass the import and fail at render or
    send on the night of the run, one problem per retry. Now every one is listed at once."""
    header, rows = sample_rows()
    rows[0]["designation"] = "D" * 81
    rows[0]["email"] = "rafiq..chowdhury@example.com"  # two problems on one row: both listed
    rows[1]["email"] = ".sadia@example.com"
    rows[2]["email"] = "sadia.@example.com"
    rows[3]["department"] = "X" * 61
    rows[4]["email"] = "a@" + "x" * 64 + ".com"  # a domain label is at most 63 characters
    path = write_csv(tmp_path / "in.csv", header, rows)
    before = dump(seeded)
    with pytest.raises(InputError) as e:
        P.import_csv(seeded, path)
    got = [(line, why.split(" ")[0]) for line, why in e.value.problems]  # type: ignore[attr-defined]
    assert got == [(2, "designation"), (2, "email"), (3, "email"), (4, "email"), (5, "department"), (6, "email")]
    assert "designation is 81 characters; the slip has room for 80" in str(e.value)
    assert dump(seeded) == before
    companies = tmp_path / "companies.csv"
    companies.write_text("id,name,address\n9,\"" + "N" * 81 + "\",Dhaka\n", encoding="utf-8")
    with pytest.raises(InputError, match="name is 81 characters; the slip has room for 80"):
        P.import_companies_csv(seeded, companies)


def test_the_imports_text_limits_are_the_slips():
    from jobs import slip

    assert P.SLIP_TEXT_MAX == {**slip.COMPANY_FIELDS, "name_en": slip.EMPLOYEE_FIELDS["name_en"],
                               "name_bn": slip.NAME_BN_MAX, "department": slip.EMPLOYEE_FIELDS["department"],
                               "designation": slip.EMPLOYEE_FIELDS["designation"]}


def test_amount_errors_never_echo_salary_figures(seeded: P.PayrollDB, tmp_path: Path) -> None:
    """An import's errors reach terminals, cron mail and logs: they say what is wrong with
    an amount (its form, digits shown as 9) but never the figure itself."""
    header, rows = sample_rows()
    rows[0].update(basic="73,412.5", loan="861")
    rows[1].update(tax="52817.125")
    rows[2].update(loan="987654")  # deductions over earnings
    rows[3].update(basic="৪৫,০০০")  # Bengali digits: HR may type them
    rows[4].update(medical="４５００.１２５")  # full-width
    path = write_csv(tmp_path / "in.csv", header, rows)
    with pytest.raises(InputError) as e:
        P.import_csv(seeded, path)
    msg = str(e.value)
    assert "line 2: basic '99,999.9' (digits shown as 9) is not an amount" in msg
    assert "line 3: tax '99999.999' (digits shown as 9) has more than 2 decimals" in msg
    assert "line 5: basic '99,999' (digits shown as 9) is not an amount" in msg  # Bengali digits
    assert "line 6: medical '9999.999' (digits shown as 9) has more than 2 decimals" in msg
    assert "line 4: deductions (tax, provident_fund, loan) exceed earnings" in msg
    figures = [rows[2][f] for f in P.AMOUNT_FIELDS if len(rows[2][f]) >= 3]  # (not "0")
    figures += ["73", "412", "52817", "987654", "9876.54", "৪৫", "০০০", "৪", "４５００", "５", "4500.125"]
    # the message names the file; its temp path (".../pytest-73/...") may hold any digits
    assert msg.startswith(f"{path}: ")
    said = msg[len(f"{path}: "):]
    for figure in figures:
        assert figure not in said, figure


def test_an_employee_without_a_bengali_name_imports_and_gets_a_slip(seeded: P.PayrollDB, tmp_path: Path) -> None:
    """Expatriate staff have no Bengali name: the import takes an empty name_bn (every
    other field is still required), and the slip shows the Latin name alone."""
    from jobs import slip

    header, rows = sample_rows()
    rows[0]["name_bn"] = ""
    rows[1]["name_bn"] = "   "
    path = write_csv(tmp_path / "in.csv", header, rows)
    assert P.import_csv(seeded, path).employees == 12
    s = P.employee_snapshot(seeded, MONTH, rows[0]["employee_id"])
    assert s["employee"]["name_bn"] == "" and s["employee"]["name_en"] == rows[0]["name_en"]
    assert P.employee_snapshot(seeded, MONTH, rows[1]["employee_id"])["employee"]["name_bn"] == ""
    html = slip.render_html(s)
    assert rows[0]["name_en"] in html and 'class="name-bn"' not in html
    assert slip.render_pdf(s).startswith(b"%PDF")


def test_a_slip_of_an_earlier_month_keeps_that_months_employer(seeded: P.PayrollDB, tmp_path: Path) -> None:
    """An employee moved to another company in a later month: a resend of November's slip
    still shows November's employer (it showed today's), and November's run and counts
    still count it there."""
    header, rows = sample_rows()
    path = write_csv(tmp_path / "nov.csv", header, rows)
    P.import_csv(seeded, path)
    emp = rows[0]["employee_id"]
    nov_company = int(rows[0]["company_id"])
    other = next(c["id"] for c in P.companies(seeded) if c["id"] != nov_company)
    moved = dict(rows[0], company_id=str(other), month="2027-02")
    P.import_csv(seeded, write_csv(tmp_path / "feb.csv", header, [moved]))
    nov = P.employee_snapshot(seeded, MONTH, emp)
    assert nov["company"]["id"] == nov_company
    assert P.employee_snapshot(seeded, "2027-02", emp)["company"]["id"] == other
    assert emp in P.employee_ids(seeded, MONTH, nov_company) and emp not in P.employee_ids(seeded, MONTH, other)
    assert [s["employee"]["id"] for s in P.snapshots(seeded, MONTH, other)].count(emp) == 0
    assert emp in P.employee_ids_by_company(seeded, "2027-02")[other]
    assert P.company_ids_for(seeded, "2027-02") == [other]


def test_a_months_company_details_are_kept_once_and_read_by_its_snapshots(seeded: P.PayrollDB, tmp_path: Path) -> None:
    """keep_company_details records a company's name and address for a month once (a second
    call after a rename changes nothing); that month's snapshots read them, other months
    and months never run read today's."""
    cid = P.companies(seeded)[0]["id"]
    before = P.companies(seeded)[0]
    P.keep_company_details(seeded, MONTH, cid)
    seeded.conn.execute("UPDATE companies SET name = 'New Name Ltd', address = 'Sylhet' WHERE id = ?", [cid])
    seeded.conn.commit()
    P.keep_company_details(seeded, MONTH, cid)  # (a resumed or topped-up run: no change)
    nov = [s for s in P.snapshots(seeded, MONTH, cid)]
    assert nov and all(s["company"] == before for s in nov)
    assert P.months_kept(seeded, [cid]) == {cid: [MONTH]} and P.months_kept(seeded, []) == {}
    assert P.ensure_month(seeded, "2026-12") > 0
    assert {s["company"]["name"] for s in P.snapshots(seeded, "2026-12", cid)} == {"New Name Ltd"}
    c = tmp_path / "c.csv"
    c.write_text(f"id,name,address\n{cid},Newer Name Ltd,Sylhet\n", encoding="utf-8")
    assert P.import_companies_csv(seeded, c).kept_months == {cid: [MONTH]}


def test_salary_lines_from_before_they_had_a_company_read_the_employees(tmp_path: Path) -> None:
    """A payroll database made before salary lines had company_id gets the column on open,
    each old line the employee's company (what its slips showed until then)."""
    import sqlite3

    path = tmp_path / "payroll.db"
    db = P.PayrollDB(path)
    P.seed(db, companies=2, employees=10, seed=3, month=MONTH)
    db.close()
    con = sqlite3.connect(path)
    con.execute("DROP INDEX idx_salary_lines_month_company_id_employee_id")  # as an older payrun made it
    con.execute("ALTER TABLE salary_lines DROP COLUMN company_id")
    con.commit()
    con.close()
    db = P.PayrollDB(path)
    try:
        assert db.db.execute("SELECT count(*) FROM salary_lines WHERE company_id IS NULL").fetchone()[0] == 0
        snaps = list(P.snapshots(db, MONTH))
        assert len(snaps) == 10 and P.company_ids_for(db, MONTH) == [1, 2]
        for s in snaps:
            cid = db.db.execute("SELECT company_id FROM employees WHERE id = ?", [s["employee"]["id"]]).fetchone()[0]
            assert s["company"]["id"] == cid
    finally:
        db.close()


def test_amounts_in_bengali_digits_are_read(seeded: P.PayrollDB, tmp_path: Path) -> None:
    """HR may type amounts in Bengali (or full-width) digits: they are the same numbers."""
    header, rows = sample_rows()
    rows[0].update(basic="৪৫০০০.৫০", loan="০")
    rows[1].update(medical="４５００")
    P.import_csv(seeded, write_csv(tmp_path / "in.csv", header, rows))
    a = P.employee_snapshot(seeded, MONTH, rows[0]["employee_id"])
    assert a["earnings"]["basic"] == 4500050 and a["deductions"]["loan"] == 0
    assert P.employee_snapshot(seeded, MONTH, rows[1]["employee_id"])["earnings"]["medical"] == 450000


def test_a_retried_resend_stays_marked_re_issued(seeded: P.PayrollDB) -> None:
    """A failed resend, retried after HR fixed the data, re-reads the employee's data but
    keeps its key, its company and its re-issued date."""
    from types import SimpleNamespace

    from payrun.deadletters import _refresh_snapshot

    emp = next(iter(P.employee_ids(seeded, MONTH)))
    old = P.employee_snapshot(seeded, MONTH, emp)
    old.update(key=f"slip:{MONTH}:{emp}:resend-1", reissued="2026-12-04")
    old["employee"]["name_en"] = "Too long " * 20
    job = SimpleNamespace(func_name="jobs.oneoff.resend_slip", args=(old,))
    _refresh_snapshot(job, seeded)
    new = job.args[0]
    assert new["employee"]["name_en"] != old["employee"]["name_en"]  # today's data
    assert new["key"] == old["key"] and new["reissued"] == "2026-12-04"
