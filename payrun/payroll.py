"""The payroll database: schema, deterministic sample data, CSV import, slip snapshots.

SQLite file at a path the caller gives (normally ``Config.payroll_path``), opened with
sqlite-utils in WAL mode with foreign keys on. The directory is created 0700 and the file
0600 (only when payrun creates them): it holds full bank account numbers, which never
leave this module except masked (``•••• 4821``) — not in snapshots, not in error messages.

Tables (amounts are INTEGER poisha, 1/100 taka, never floats)::

    companies    (id INTEGER PK, name, address)
    employees    (id TEXT PK 'emp-00017', company_id FK, name_en, name_bn, email,
                  department, designation, bank_account, active INTEGER DEFAULT 1,
                  left_on: the leaving date 'YYYY-MM-DD' `payrun employee left` recorded, else NULL)
    salary_lines (employee_id FK, month 'YYYY-MM', basic, house_rent, medical, conveyance,
                  bonus, tax, provident_fund, loan, PK(employee_id, month), company_id,
                  corrected_at: UTC ISO time an import last changed its figures, else NULL)

Public API::

    PayrollDB(path)                              open/create (idempotent schema)
    seed(db, companies=60, employees=50000, seed=7, month="2026-11", progress=None, reset=False)
    ensure_month(db, month, seed=None) -> int    copy the latest month's lines if month has none
    import_csv(db, path, today=None) -> ImportResult   employees + salary lines (+ leaving dates), all-or-nothing
    import_companies_csv(db, path) -> ImportResult
    snapshots(db, month, company_id=None) -> Iterator[dict]   (docs/ARCHITECTURE.md shape)
    in_month_run(active, left_on, month) -> bool   whom a month's run pays (IN_MONTH_RUN in SQL)
    employee_snapshot(db, month, employee_id) -> dict
    companies(db), company_ids_for(db, month, company_id=None), count_employees(db, month, ...)
    months(db) -> list[str]

Every function taking ``db`` accepts a ``PayrollDB`` or a bare ``sqlite_utils.Database``.
"""

from __future__ import annotations

import csv
import io
import os
import random
import re
import sqlite3
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import sqlite_utils

from payrun import keys
from payrun.errors import InputError
from payrun.text import text_problem

LEFT_ON_TRIGGER = "employees_active_forgets_left_on"
CORRECTED_AT_TRIGGER = "salary_lines_figures_stamp_corrected_at"
"""Triggers PayrollDB adds on open (with the columns they keep): they hold for whichever
version of payrun writes the database, the one before them included (a rolling deploy)."""

AMOUNT_FIELDS = (
    "basic", "house_rent", "medical", "conveyance", "bonus", "tax", "provident_fund", "loan",
)
EARNINGS = ("basic", "house_rent", "medical", "conveyance", "bonus")
DEDUCTIONS = ("tax", "provident_fund", "loan")
EMPLOYEE_FIELDS = (
    "name_en", "name_bn", "email", "department", "designation", "bank_account",
)
CSV_COLUMNS = (
    "company_id", "employee_id", *EMPLOYEE_FIELDS, "month", *AMOUNT_FIELDS,
)
OPTIONAL_CSV_COLUMNS = ("left_on",)
"""Columns an employees file may have: ``left_on``, the day an employee left (YYYY-MM-DD;
empty: not a leaver, or no change), which marks them left as `payrun employee left --on`."""
COMPANY_CSV_COLUMNS = ("id", "name", "address")

MAX_LISTED_PROBLEMS = 50
MAX_TEXT_LEN = 200
MAX_AMOUNT_TAKA = 1_000_000_000  # 100 crore taka a month: anything above is a typo
MASK = "•••• "

ProgressFn = Callable[[int, int], None]


# ---------------------------------------------------------------------------
# The database
# ---------------------------------------------------------------------------

class PayrollDB:
    """A payroll SQLite file. Creates directory (0700), file (0600) and tables if missing."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.created = str(path) != ":memory:" and _create_private_file(self.path)
        """This object created the database file (it was not there)."""
        self.db = sqlite_utils.Database(self.path)
        self.db.conn.execute("PRAGMA foreign_keys = ON")
        self.db.conn.execute("PRAGMA busy_timeout = 10000")
        if str(path) != ":memory:":
            self.db.enable_wal()
        self.create_tables()

    @property
    def conn(self) -> sqlite3.Connection:
        return self.db.conn

    def create_tables(self) -> None:
        """Create missing tables and indexes; existing ones are left alone."""
        d = self.db
        strict = d.supports_strict
        with d.atomic():
            d["companies"].create(
                {"id": int, "name": str, "address": str},
                pk="id", not_null={"name", "address"}, if_not_exists=True, strict=strict,
            )
            d["employees"].create(
                {
                    "id": str, "company_id": int, "name_en": str, "name_bn": str,
                    "email": str, "department": str, "designation": str,
                    "bank_account": str, "active": int,
                },
                pk="id",
                foreign_keys=[("company_id", "companies", "id")],
                not_null={"company_id", "name_en", "name_bn", "email", "department",
                          "designation", "bank_account", "active"},
                defaults={"active": 1},
                if_not_exists=True, strict=strict,
            )
            d["salary_lines"].create(
                {"employee_id": str, "month": str, **{f: int for f in AMOUNT_FIELDS}},
                pk=("employee_id", "month"),
                foreign_keys=[("employee_id", "employees", "id")],
                not_null={"employee_id", "month", *AMOUNT_FIELDS},
                if_not_exists=True, strict=strict,
            )
            if "company_id" not in d["salary_lines"].columns_dict:
                # the employer of that month; a database from before it gets each line's
                # employee's company of today (what its slips showed until now)
                d["salary_lines"].add_column("company_id", int)
                d.execute("UPDATE salary_lines SET company_id = (SELECT company_id FROM employees "
                          "WHERE employees.id = salary_lines.employee_id) WHERE company_id IS NULL")
            if "left_on" not in d["employees"].columns_dict:
                # the day a leaver left (`payrun employee left --on`); NULL for those marked
                # before it, and for everyone still here. No default: no row is rewritten.
                d["employees"].add_column("left_on", str)
            if "corrected_at" not in d["salary_lines"].columns_dict:
                # when an import last changed a line's figures: a resend after it is a
                # corrected slip (jobs.policy.reissue_marks). NULL for lines before it.
                d["salary_lines"].add_column("corrected_at", str)
            # A rolling deploy or a roll-back runs the version before these columns on this
            # database (an `employee back` or `left`, an `import`): the database keeps them
            # true whoever writes. A change of `active` forgets the leaving date (an earlier
            # version's `back` then `left` showed the first leaving's date; set_active writes
            # the new one after), and figures changed stamp `corrected_at` (an earlier
            # version's import of a correction read "Re-issued", not "Corrected").
            d.execute(f"CREATE TRIGGER IF NOT EXISTS {LEFT_ON_TRIGGER} AFTER UPDATE OF active ON employees "
                      "WHEN NEW.active IS NOT OLD.active "
                      "BEGIN UPDATE employees SET left_on = NULL WHERE id = NEW.id; END")
            changed = " OR ".join(f"NEW.{f} IS NOT OLD.{f}" for f in AMOUNT_FIELDS)
            d.execute(f"CREATE TRIGGER IF NOT EXISTS {CORRECTED_AT_TRIGGER} AFTER UPDATE OF {', '.join(AMOUNT_FIELDS)} "
                      f"ON salary_lines WHEN {changed} BEGIN UPDATE salary_lines SET corrected_at = "
                      f"strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now') WHERE employee_id = NEW.employee_id "
                      "AND month = NEW.month; END")
            # a company's name and address as its month was run: a slip of that month
            # (a resend, a retry, a newcomer's top-up) prints them, not a later rename
            d["company_months"].create(
                {"month": str, "company_id": int, "name": str, "address": str},
                pk=("month", "company_id"), not_null={"month", "company_id", "name", "address"},
                if_not_exists=True, strict=strict,
            )
            d["salary_lines"].create_index(["month"], if_not_exists=True)
            # a company's lines of a month in employee order: the fan-out reads them so
            d["salary_lines"].create_index(["month", "company_id", "employee_id"], if_not_exists=True)
            d["employees"].create_index(["company_id", "id"], if_not_exists=True)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "PayrollDB":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _create_private_file(path: Path) -> bool:
    """Create ``path`` (mode 0600, parent folders 0700) unless it exists (then make it, its
    SQLite sidecars and its folder owner-only again); True if this call created it."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        from payrun.files import sqlite_owner_only

        sqlite_owner_only(path)  # every salary and bank account: one restored at 0644 is made 0600 again
        return False
    os.close(fd)
    os.chmod(path, 0o600)  # os.open's mode is filtered by umask; make it exactly 0600
    return True


def _sdb(db: "PayrollDB | sqlite_utils.Database") -> sqlite_utils.Database:
    return db.db if isinstance(db, PayrollDB) else db


# ---------------------------------------------------------------------------
# Sample data
# ---------------------------------------------------------------------------

# (Latin, Bengali) pairs. First names by community and gender; surnames likewise, so a
# generated name is one a Bangladeshi would recognise ("Nusrat Akter", "Sourav Saha").
MUSLIM_MALE = [
    ("Tanvir", "তানভীর"), ("Rafiq", "রফিক"), ("Karim", "করিম"), ("Hasan", "হাসান"),
    ("Imran", "ইমরান"), ("Arif", "আরিফ"), ("Sakib", "সাকিব"), ("Fahim", "ফাহিম"),
    ("Mahmud", "মাহমুদ"), ("Rashed", "রাশেদ"), ("Sohel", "সোহেল"), ("Jahid", "জাহিদ"),
    ("Nayeem", "নাঈম"), ("Rubel", "রুবেল"), ("Shafiq", "শফিক"), ("Kamal", "কামাল"),
    ("Jamal", "জামাল"), ("Mizanur", "মিজানুর"), ("Anisur", "আনিসুর"), ("Habib", "হাবিব"),
    ("Sumon", "সুমন"), ("Faisal", "ফয়সাল"), ("Shakil", "শাকিল"), ("Masud", "মাসুদ"),
]
MUSLIM_FEMALE = [
    ("Nusrat", "নুসরাত"), ("Farhana", "ফারহানা"), ("Sadia", "সাদিয়া"), ("Tasnim", "তাসনিম"),
    ("Shirin", "শিরিন"), ("Ayesha", "আয়েশা"), ("Fatema", "ফাতেমা"), ("Nasrin", "নাসরিন"),
    ("Sharmin", "শারমিন"), ("Rumana", "রুমানা"), ("Jannat", "জান্নাত"), ("Mariam", "মরিয়ম"),
    ("Lima", "লিমা"), ("Tahmina", "তাহমিনা"), ("Sabina", "সাবিনা"), ("Mousumi", "মৌসুমী"),
    ("Parvin", "পারভীন"), ("Rabeya", "রাবেয়া"),
]
HINDU_MALE = [
    ("Sourav", "সৌরভ"), ("Pritam", "প্রীতম"), ("Amit", "অমিত"), ("Sudip", "সুদীপ"),
    ("Tapan", "তপন"), ("Arjun", "অর্জুন"),
]
HINDU_FEMALE = [
    ("Ananya", "অনন্যা"), ("Dipa", "দীপা"), ("Puja", "পূজা"), ("Rupa", "রূপা"),
    ("Mitu", "মিতু"), ("Srabanti", "শ্রাবন্তী"),
]
MUSLIM_SURNAMES = [
    ("Ahmed", "আহমেদ"), ("Rahman", "রহমান"), ("Hossain", "হোসেন"), ("Islam", "ইসলাম"),
    ("Chowdhury", "চৌধুরী"), ("Khan", "খান"), ("Uddin", "উদ্দিন"), ("Alam", "আলম"),
    ("Haque", "হক"), ("Karim", "করিম"), ("Sarker", "সরকার"), ("Mia", "মিয়া"),
    ("Talukder", "তালুকদার"), ("Bhuiyan", "ভূঁইয়া"), ("Siddique", "সিদ্দিকী"),
    ("Kabir", "কবির"), ("Molla", "মোল্লা"), ("Sheikh", "শেখ"),
]
MUSLIM_FEMALE_SURNAMES = [
    ("Akter", "আক্তার"), ("Begum", "বেগম"), ("Sultana", "সুলতানা"), ("Khatun", "খাতুন"),
]
HINDU_SURNAMES = [
    ("Das", "দাস"), ("Roy", "রায়"), ("Saha", "সাহা"), ("Paul", "পাল"), ("Ghosh", "ঘোষ"),
    ("Dey", "দে"), ("Chakraborty", "চক্রবর্তী"), ("Sen", "সেন"), ("Biswas", "বিশ্বাস"),
    ("Mondal", "মন্ডল"),
]

COMPANY_PREFIXES = [
    "Meghna", "Padma", "Jamuna", "Karnaphuli", "Surma", "Teesta", "Rupsha", "Buriganga",
    "Sundarban", "Shapla", "Doel", "Sonargaon", "Lalbagh", "Mahananda", "Kushiyara",
    "Dhaleshwari", "Madhumati", "Bengal", "Delta", "Gazi", "Shitalakshya", "Brahmaputra",
    "Kirtankhola", "Chalan Beel",
]
COMPANY_INDUSTRIES = [
    "Textiles", "Pharmaceuticals", "Garments", "Knit Composite", "Agro", "Steel Mills",
    "Cement", "Logistics", "Ceramics", "Foods", "Software", "Shipping", "Leather",
    "Jute Mills", "Tea Estates", "Plastics", "Paper Mills", "Packaging", "Denim",
    "Electronics",
]
COMPANY_SUFFIXES = ["Ltd", "Ltd", "Limited", "PLC", ""]
ADDRESS_AREAS = [  # (area, city, postcode)
    ("Dhanmondi", "Dhaka", "1205"), ("Gulshan", "Dhaka", "1212"), ("Banani", "Dhaka", "1213"),
    ("Motijheel", "Dhaka", "1000"), ("Uttara", "Dhaka", "1230"), ("Mirpur", "Dhaka", "1216"),
    ("Tejgaon", "Dhaka", "1208"), ("Mohakhali", "Dhaka", "1212"),
    ("Bashundhara", "Dhaka", "1229"), ("Karwan Bazar", "Dhaka", "1215"),
    ("Agrabad", "Chattogram", "4100"), ("Khulshi", "Chattogram", "4225"),
    ("Panchlaish", "Chattogram", "4203"), ("Halishahar", "Chattogram", "4216"),
    ("Nasirabad", "Chattogram", "4210"),
]
# department -> [(designation, basic low, basic high in taka, weight)]
DEPARTMENTS: dict[str, list[tuple[str, int, int, int]]] = {
    "Production": [("Machine Operator", 15000, 22000, 10), ("Line Supervisor", 22000, 35000, 5),
                   ("Production Officer", 30000, 55000, 3),
                   ("Production Manager", 90000, 170000, 1)],
    "Quality Assurance": [("Quality Inspector", 18000, 30000, 4), ("QA Officer", 30000, 55000, 2)],
    "Finance": [("Accounts Officer", 25000, 45000, 4), ("Senior Accountant", 40000, 70000, 2),
                ("Finance Manager", 90000, 160000, 1)],
    "Human Resources": [("HR Executive", 25000, 45000, 3), ("HR Manager", 80000, 140000, 1)],
    "Sales": [("Sales Executive", 22000, 40000, 5), ("Area Sales Manager", 60000, 110000, 1)],
    "Marketing": [("Marketing Executive", 25000, 45000, 3), ("Brand Manager", 80000, 150000, 1)],
    "Information Technology": [("Software Engineer", 45000, 110000, 3),
                               ("System Administrator", 40000, 80000, 2),
                               ("Head of IT", 150000, 250000, 1)],
    "Supply Chain": [("Store Keeper", 16000, 25000, 3), ("Procurement Officer", 30000, 55000, 2),
                     ("Logistics Manager", 80000, 140000, 1)],
    "Administration": [("Office Assistant", 15000, 20000, 4), ("Admin Officer", 25000, 40000, 2),
                       ("General Manager", 180000, 250000, 1)],
    "Compliance": [("Compliance Officer", 35000, 65000, 1)],
}
DEPARTMENT_WEIGHTS = {
    "Production": 40, "Quality Assurance": 8, "Finance": 8, "Human Resources": 5, "Sales": 12,
    "Marketing": 6, "Information Technology": 6, "Supply Chain": 8, "Administration": 5,
    "Compliance": 2,
}
# Months with an Eid (festival bonus = one basic for everyone). Approximate: moon-sighting.
EID_MONTHS = frozenset({
    "2025-03", "2025-06", "2026-03", "2026-05", "2027-03", "2027-05", "2028-02", "2028-05",
})
# Monthly tax brackets on basic + conveyance (house rent and medical treated as exempt):
# (width in taka, rate). Progressive-ish and small, loosely after the Bangladeshi slabs.
TAX_BRACKETS = [(29000, 0.0), (8000, 0.05), (33000, 0.10), (42000, 0.15), (42000, 0.20),
                (None, 0.25)]


def _slug(name: str) -> str:
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    words = [w for w in words if w not in {"ltd", "limited", "plc"}]
    return "-".join(words)


def _tax_taka(basic: int, conveyance: int) -> int:
    left, tax = basic + conveyance, 0.0
    for width, rate in TAX_BRACKETS:
        part = left if width is None else min(left, width)
        tax += part * rate
        left -= part
        if left <= 0:
            break
    return int(tax)


def _gen_companies(rng: random.Random, n: int) -> list[dict[str, Any]]:
    combos = [(p, i) for p in COMPANY_PREFIXES for i in COMPANY_INDUSTRIES]
    picks = rng.sample(combos, min(n, len(combos)))
    out = []
    for k in range(n):
        prefix, industry = picks[k % len(picks)]
        suffix = rng.choice(COMPANY_SUFFIXES)
        name = " ".join(x for x in (prefix, industry, suffix) if x)
        if k >= len(picks):
            name += f" {k // len(picks) + 1}"
        area, city, post = rng.choice(ADDRESS_AREAS)
        address = f"House {rng.randint(1, 120)}, Road {rng.randint(1, 32)}, {area}, {city} {post}"
        out.append({"id": k + 1, "name": name, "address": address})
    return out


def _company_of_each_employee(rng: random.Random, n_comp: int, n_emp: int) -> list[int]:
    """Uneven sizes (log-normal weights); every company gets one when n_emp >= n_comp."""
    weights = [rng.lognormvariate(0.0, 1.0) for _ in range(n_comp)]
    ids = list(range(1, n_comp + 1))
    if n_emp >= n_comp:
        assigned = ids + rng.choices(ids, weights=weights, k=n_emp - n_comp)
    else:
        assigned = rng.choices(ids, weights=weights, k=n_emp)
    rng.shuffle(assigned)  # hires interleave across companies over time
    return assigned


def _pick_name(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    hindu = rng.random() < 0.10
    female = rng.random() < 0.45
    if hindu:
        first = rng.choice(HINDU_FEMALE if female else HINDU_MALE)
        last = rng.choice(HINDU_SURNAMES)
    else:
        first = rng.choice(MUSLIM_FEMALE if female else MUSLIM_MALE)
        if female and rng.random() < 0.4:
            last = rng.choice(MUSLIM_FEMALE_SURNAMES)
        else:
            last = rng.choice(MUSLIM_SURNAMES)
            while last[0] == first[0]:  # no "Karim Karim"
                last = rng.choice(MUSLIM_SURNAMES)
    return first, last


def _bonus_taka(mrng: random.Random, basic: int, month: str) -> int:
    """Festival bonus (one basic) in Eid months; otherwise rarely a performance bonus."""
    if month in EID_MONTHS:
        return basic
    if mrng.random() < 0.03:
        return round(basic * mrng.choice((0.1, 0.25, 0.5)) / 100) * 100
    return 0


def _month_rng(seed: int, month: str) -> random.Random:
    return random.Random(f"payrun:{seed}:{month}")


def seed(
    db: "PayrollDB | sqlite_utils.Database",
    companies: int = 60,
    employees: int = 50000,
    seed: int = 7,
    month: str = "2026-11",
    progress: ProgressFn | None = None,
    reset: bool = False,
) -> None:
    """Write deterministic sample data: companies, employees, salary lines for ``month``.

    Same arguments -> identical rows (rows are upserted, so seeding twice is harmless;
    rows that other arguments or an import added are kept unless ``reset=True``, which
    first empties all three tables). Companies, employees and each employee's standing
    pay (basic, allowances, tax, PF, loan) depend only on ``seed``; the bonus also
    depends on ``month``, so seeding another month gives the same people and pay.
    One transaction; ``progress(done, total)`` is called per batch of employees.
    """
    _check_month(month)
    if companies < 1 or employees < 0:
        raise InputError(f"seed needs companies >= 1 and employees >= 0 "
                         f"(got {companies}, {employees})")
    d = _sdb(db)
    rng = random.Random(seed)
    mrng = _month_rng(seed, month)
    comps = _gen_companies(rng, companies)
    slugs = {c["id"]: _slug(c["name"]) for c in comps}
    owner = _company_of_each_employee(rng, companies, employees)
    depts = list(DEPARTMENTS)
    dept_w = [DEPARTMENT_WEIGHTS[x] for x in depts]
    width = max(5, len(str(employees)))
    batch = 5000

    with d.atomic():
        if reset:
            for t in ("salary_lines", "employees", "companies"):
                d.execute(f"DELETE FROM {t}")
        d["companies"].upsert_all(comps, pk="id")
        emps: list[dict[str, Any]] = []
        lines: list[dict[str, Any]] = []
        for k in range(employees):
            n = k + 1
            emp_id = f"emp-{n:0{width}d}"
            cid = owner[k]
            (f_en, f_bn), (l_en, l_bn) = _pick_name(rng)
            dept = rng.choices(depts, weights=dept_w)[0]
            roles = DEPARTMENTS[dept]
            title, lo, hi, _ = rng.choices(roles, weights=[r[3] for r in roles])[0]
            basic = round(rng.uniform(lo, hi) / 100) * 100
            conveyance = rng.choice((1500, 2000, 2500, 3000)) if basic < 80000 else 5000
            loan = min(rng.choice((2000, 3000, 5000, 8000, 10000)), basic // 2) \
                if rng.random() < 0.07 else 0
            bank = f"{rng.randrange(10**12, 10**13)}"
            emps.append({
                "id": emp_id, "company_id": cid, "name_en": f"{f_en} {l_en}",
                "name_bn": f"{f_bn} {l_bn}",
                "email": f"{f_en.lower()}.{l_en.lower()}.{n}@{slugs[cid]}.example",
                "department": dept, "designation": title, "bank_account": bank, "active": 1,
            })
            taka = {
                "basic": basic, "house_rent": basic // 2, "medical": basic // 10,
                "conveyance": conveyance, "bonus": _bonus_taka(mrng, basic, month),
                "tax": _tax_taka(basic, conveyance), "provident_fund": basic // 10,
                "loan": loan,
            }
            lines.append({"employee_id": emp_id, "month": month, "company_id": cid,
                          **{f: v * 100 for f, v in taka.items()}})
            if len(emps) >= batch or n == employees:
                d["employees"].upsert_all(emps, pk="id", batch_size=500)
                d["salary_lines"].upsert_all(lines, pk=("employee_id", "month"), batch_size=500)
                emps, lines = [], []
                if progress:
                    progress(n, employees)
    if progress and employees == 0:
        progress(0, 0)


def months(db: "PayrollDB | sqlite_utils.Database") -> list[str]:
    """Months that have salary lines, oldest first."""
    return [r[0] for r in _sdb(db).execute(
        "SELECT DISTINCT month FROM salary_lines ORDER BY month")]


def ensure_month(db: "PayrollDB | sqlite_utils.Database", month: str,
                 seed: int | None = None) -> int:
    """Make sure ``month`` has salary lines, so a run for a new month works on sample data.

    If ``month`` already has lines: nothing happens, returns 0. Otherwise copies every line
    of the latest earlier month (or, if there is none, the latest month at all) to
    ``month`` with bonus 0 — a bonus is one-off; loan installments and pay carry over —
    and returns the number of lines written (0 if the database has no lines at all).
    With ``seed`` given, bonuses for the new month are drawn by the sample-data rules
    instead (festival bonus in Eid months, rare performance bonus), deterministically.
    """
    _check_month(month)
    d = _sdb(db)
    if d.execute("SELECT 1 FROM salary_lines WHERE month = ? LIMIT 1", [month]).fetchone():
        return 0
    src = d.execute("SELECT max(month) FROM salary_lines WHERE month < ?", [month]).fetchone()[0]
    if src is None:
        src = d.execute("SELECT max(month) FROM salary_lines").fetchone()[0]
    if src is None:
        return 0
    cols = ", ".join(AMOUNT_FIELDS)
    copied = ", ".join("0" if f == "bonus" else f for f in AMOUNT_FIELDS)
    with d.atomic():
        cur = d.execute(
            f"INSERT INTO salary_lines (employee_id, month, company_id, {cols}) "
            f"SELECT s.employee_id, ?, e.company_id, {copied} FROM salary_lines s "
            f"JOIN employees e ON e.id = s.employee_id WHERE s.month = ?",
            [month, src])
        n = cur.rowcount
        if seed is not None:
            mrng = _month_rng(seed, month)
            rows = d.execute("SELECT employee_id, basic FROM salary_lines WHERE month = ? "
                             "ORDER BY employee_id", [month]).fetchall()
            updates = []
            for emp_id, basic in rows:
                bonus = _bonus_taka(mrng, basic // 100, month) * 100
                if bonus:
                    updates.append((bonus, emp_id, month))
            d.conn.executemany(
                "UPDATE salary_lines SET bonus = ? WHERE employee_id = ? AND month = ?", updates)
    return n


# ---------------------------------------------------------------------------
# CSV import
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ImportResult:
    companies: int = 0
    """Distinct companies the imported rows belong to (or companies written)."""
    employees: int = 0
    """Distinct employees inserted or updated."""
    salary_lines: int = 0
    """Salary lines inserted or updated."""
    changed_lines: int = 0
    """Employees import: of ``salary_lines``, those that replaced a line of the same
    employee and month with other figures or company (the rest are new or the same)."""
    new_lines: int = 0
    """Employees import: of ``salary_lines``, those of an employee and month with no line before."""
    updated: list[int] = field(default_factory=list)
    """Companies import: ids that existed with another name or address (now replaced)."""
    unchanged: int = 0
    """Companies import: rows identical to the company already there."""
    existing_employees: list[str] = field(default_factory=list)
    """Employees import: ids that were in the database already (their details replaced)."""
    months: list[str] = field(default_factory=list)
    """Employees import: the months of the salary lines imported."""
    employee_ids: list[str] = field(default_factory=list)
    """Employees import: every employee id in the file."""
    corrected: dict[str, list[int]] = field(default_factory=dict)
    """Companies import with ``months``: month -> the companies whose kept name and
    address for that month (``company_months``) the file replaced."""
    changed_employees: list[str] = field(default_factory=list)
    """Employees import: of ``existing_employees``, those whose details (name, email,
    company, ...) the file changed."""
    moved: list[tuple[str, int, int]] = field(default_factory=list)
    """Employees import: (employee, company before, company now) for each one the file
    moved to another company."""
    ignored_columns: list[str] = field(default_factory=list)
    """Columns of the file that are not payrun's: not imported (an `active` or `overtime`
    column does nothing)."""
    kept_months: dict[int, list[str]] = field(default_factory=dict)
    """Companies import: of ``updated``, company id -> the months already run, whose slips
    (resends included) keep the name and address they were run with."""
    changed_slips: dict[str, list[str]] = field(default_factory=dict)
    """Employees import: month -> employees whose slip for that month (a salary line that
    existed) now reads differently: amounts, name, company, ... ."""
    readdressed: dict[str, list[str]] = field(default_factory=dict)
    """Employees import: month -> employees whose slip for that month reads the same but
    goes to another email address now (the slip does not print it)."""
    new_address: list[str] = field(default_factory=list)
    """Employees import: of ``existing_employees``, those whose email address the file
    changed (every month's slip goes there from now on, months not in the file too)."""
    left: dict[str, str] = field(default_factory=dict)
    """Employees import: employee -> the leaving date the file's ``left_on`` gave (marked
    left with it, or their date corrected), of those whose mark or date it changed."""
    after_leaving: list[tuple[str, str]] = field(default_factory=list)
    """Employees import: (employee, month) of salary lines for a month after the one the
    employee left in (by ``left_on``): no run pays them (``in_month_run``)."""


_MONTH_RE = re.compile(r"[0-9]{4}-[0-9]{2}")
_EMP_RE = re.compile(r"emp-[0-9]{1,12}")
_BANK_RE = re.compile(r"[0-9]{8,20}")
# The local part is a dot-atom (no dot first, last or twice in a row): what mail servers
# and the provider accept (payrun/provider.py), so a slip is not refused at 02:00 for an
# address the import let in.
_EMAIL_RE = re.compile(
    r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*"
    r"@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)+")  # a domain label is at most 63

# What fits the one-page slip (jobs/slip.py COMPANY_FIELDS, EMPLOYEE_FIELDS, NAME_BN_MAX;
# tests/test_payroll.py checks they agree): the import refuses longer text, so a slip does
# not fail at render for a name the import let in.
SLIP_TEXT_MAX = {"name": 80, "address": 160, "name_en": 80, "name_bn": 80, "department": 60,
                 "designation": 80}
_AMOUNT_RE = re.compile(r"([0-9]+)(?:\.([0-9]{1,2}))?")
_INT_RE = re.compile(r"[0-9]{1,9}")


def _check_month(month: str) -> None:
    if not _valid_month(month):
        if isinstance(month, str) and _MONTH_RE.fullmatch(month) and 1 <= int(month[5:]) <= 12:
            raise InputError(f"month {month!r} is outside the years payrun takes (2000-2100)")
        raise InputError(f"month {month!r} must be YYYY-MM, like 2026-11")


def _valid_month(s: str) -> bool:
    return (isinstance(s, str) and _MONTH_RE.fullmatch(s) is not None
            and 2000 <= int(s[:4]) <= 2100 and 1 <= int(s[5:]) <= 12)


def _show(value: str) -> str:
    """A user value quoted for an error message: one line, at most 40 characters."""
    return repr(value if len(value) <= 40 else value[:37] + "...")


def _amount_shape(value: str) -> str:
    """An amount as an error message may show it: its form with every digit written 9
    ('45,000.505' -> '99,999.999', in any script's digits): it shows what is wrong, not the salary figure
    (errors reach terminals, cron mail and logs; no salary figures there)."""
    return _show(re.sub(r"\d", "9", value))  # every script's digits: Bengali ৪৫০০০ too


def _ascii_digits(s: str) -> str:
    """Digits of any script as ASCII ('৪৫০০০' -> '45000'): HR may type Bengali digits."""
    return "".join(str(unicodedata.digit(ch)) if ch.isdigit() and not ch.isascii() else ch for ch in s)


def _parse_amount(s: str) -> int:
    """'45000' / '45000.5' / '45000.50' taka -> poisha, in any script's digits ('৪৫০০০').
    Raises ValueError(reason)."""
    s = _ascii_digits(s)
    m = _AMOUNT_RE.fullmatch(s)
    if not m:
        if re.fullmatch(r"-[0-9]+(\.[0-9]*)?", s):
            raise ValueError("is negative (amounts must be >= 0)")
        if re.fullmatch(r"[0-9]+\.[0-9]{3,}", s):
            raise ValueError("has more than 2 decimals")
        raise ValueError("is not an amount in taka (like 45000 or 45000.50)")
    whole, frac = m.group(1), (m.group(2) or "")
    if int(whole) > MAX_AMOUNT_TAKA:
        raise ValueError(f"is too large (over {MAX_AMOUNT_TAKA} taka)")
    return int(whole) * 100 + int(frac.ljust(2, "0"))


def _clean_text(s: str) -> tuple[str, str | None]:
    """Strip and NFC-normalise (Bengali has composed/decomposed forms); reason if bad."""
    s = unicodedata.normalize("NFC", s.strip())
    if (why := text_problem(s)) is not None:  # control characters, line separators, bidi controls
        return s, why
    if len(s) > MAX_TEXT_LEN:
        return s, f"is longer than {MAX_TEXT_LEN} characters"
    return s, None


def _read_csv(path: str | os.PathLike[str], expected: tuple[str, ...], optional: tuple[str, ...] = ()
              ) -> tuple[list[tuple[int, dict[str, str]]], list[tuple[int, str]], list[str]]:
    """Read a UTF-8 CSV (BOM allowed). Returns ([(line, row)], [(line, problem)], the
    header's columns that are not in ``expected`` or ``optional``: not read, said by the
    import). A row has each ``optional`` column the header has (absent: not in the row).

    Raises InputError at once for problems that make the rows unreadable (file missing,
    not UTF-8, no header, missing columns). Line numbers are physical lines, header = 1;
    a row spanning lines (quoted newline) is reported at its first line.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InputError(f"{p}: line {line}: not UTF-8 text (save the file as UTF-8)") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[int, dict[str, str]]] = []
    problems: list[tuple[int, str]] = []
    header: list[str] | None = None
    prev = 0
    while True:
        start = prev + 1
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            # Cannot resynchronise reliably after a CSV syntax error: report and stop.
            problems.append((start, f"not valid CSV ({e})"))
            break
        prev = reader.line_num
        if header is None:
            header = [unicodedata.normalize("NFC", h.strip().lower()) for h in fields]
            missing = [c for c in expected if c not in header]
            if not any(header):
                raise InputError(f"{p}: line 1 must be a header row with the columns: "
                                 f"{', '.join(expected)}")
            if missing:
                hint = ""
                if set(COMPANY_CSV_COLUMNS) <= set(header) and "employee_id" not in header:
                    hint = "; this looks like a companies file: `payrun import --companies FILE`"
                elif expected == COMPANY_CSV_COLUMNS and {"company_id", "employee_id"} <= set(header):
                    hint = "; this looks like an employees file: `payrun import FILE` (without --companies)"
                elif len(header) == 1 and (";" in header[0] or "\t" in header[0]):
                    hint = "; the file seems to separate its columns with ';' or tabs: save it as comma-separated CSV"
                raise InputError(f"{p}: header (line 1) is missing column(s): "
                                 f"{', '.join(missing)} (expected: {', '.join(expected)}){hint}")
            dupes = sorted({h for h in header if h and header.count(h) > 1})
            if dupes:
                raise InputError(f"{p}: header (line 1) repeats column(s): {', '.join(dupes)}")
            continue
        if not any(f.strip() for f in fields):
            continue  # blank line
        if len(fields) != len(header):
            why = f"has {len(fields)} fields, the header has {len(header)}"
            if len(fields) > len(header) and _thousands_split(fields):
                why += THOUSANDS_HINT
            problems.append((start, why))
            continue
        rows.append((start, {h: f for h, f in zip(header, fields) if h in expected or h in optional}))
    if header is None:
        raise InputError(f"{p}: the file is empty (expected a header row: "
                         f"{', '.join(expected)})")
    if not rows and not problems:
        raise InputError(f"{p}: has a header but no data rows")
    return rows, problems, [h for h in header if h and h not in expected and h not in optional]


THOUSANDS_HINT = (" (an amount written with a thousands separator, like 45,000, splits into two fields: "
                  "write it 45000, or quote it: \"45,000\")")


def _thousands_split(fields: list[str]) -> bool:
    """Whether a row with too many fields has what an unquoted ``45,000`` makes of an
    amount: digits, then a field of exactly three digits (any script: ৪৫,০০০ too)."""
    f = [x.strip() for x in fields]
    return any(a.isdigit() and b.isdigit() and len(b) == 3 for a, b in zip(f, f[1:]))


GROUPED_AFTER = 3
"""A reason found on more lines than this is listed once, with its lines (a whole file of
unquoted 45,000s gave one error of 1,762 characters, the same words on every line)."""


def _group(problems: list[tuple[int, str]]) -> list[tuple[str, str]]:
    """(where, why) in line order: one entry per reason on many lines ("lines 2, 3, 4 and
    57 more"), else one per line."""
    lines_of: dict[str, list[int]] = {}
    for line, why in problems:
        lines_of.setdefault(why, []).append(line)
    out: list[tuple[str, str]] = []
    done: set[str] = set()
    for line, why in problems:
        lines = lines_of[why]
        if len(lines) <= GROUPED_AFTER:
            out.append((f"line {line}", why))
        elif why not in done:
            done.add(why)
            out.append((f"lines {', '.join(map(str, lines[:GROUPED_AFTER]))} and {len(lines) - GROUPED_AFTER} more",
                        why))
    return out


def _fail(path: str | os.PathLike[str], problems: list[tuple[int, str]]) -> None:
    problems = sorted(problems, key=lambda x: x[0])
    bad_rows = len({line for line, _ in problems})
    grouped = _group(problems)
    listed = "; ".join(f"{where}: {why}" for where, why in grouped[:MAX_LISTED_PROBLEMS])
    more = len(grouped) - MAX_LISTED_PROBLEMS
    if more > 0:
        listed += f"; ... and {more} more"
    err = InputError(f"{Path(path)}: {bad_rows} bad row(s), nothing imported: {listed}")
    err.problems = problems  # type: ignore[attr-defined]  # [(line, reason)] for callers
    raise err



OPTIONAL_COLUMNS = frozenset({"name_bn"})
"""Columns that may be empty: not every employee has a Bengali name (expatriate staff);
the slip then shows the Latin name alone."""


def leaving_date_problem(value: str, today: str) -> str | None:
    """Why ``value`` is no leaving date (`payrun employee left --on`, an import's
    ``left_on``; None: it is one): not a YYYY-MM-DD date, or later than ``today``
    (YYYY-MM-DD): the mark acts at once (runs of later months and reminders leave them out),
    so it is made on or after their last day."""
    from datetime import date

    if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", value or ""):
        return "a leaving date is YYYY-MM-DD, like 2026-11-20"
    try:
        date.fromisoformat(value)
    except ValueError:
        return "no such day (a leaving date is YYYY-MM-DD, like 2026-11-20)"
    if value > today:
        return (f"is after today ({today}): mark them on or after their last day (the mark acts at once: "
                "runs of later months and reminders leave them out)")
    return None


def _required_fields(row: dict[str, str], columns) -> tuple[dict[str, str], list[str], list[str]]:
    """Clean every column of one CSV row. Returns the values, the reasons for any empty
    (outside OPTIONAL_COLUMNS) or unclean field (the row's other checks cannot run), and
    text too long for the slip (they can: every problem of a row is listed at once)."""
    why: list[str] = []
    too_long: list[str] = []
    vals: dict[str, str] = {}
    for col in columns:
        v, bad = _clean_text(row[col])
        vals[col] = v
        if not v:
            if col not in OPTIONAL_COLUMNS:
                why.append(f"{col} is empty")
        elif bad:
            why.append(f"{col} {bad}")
        elif col in SLIP_TEXT_MAX and len(v) > SLIP_TEXT_MAX[col]:
            too_long.append(f"{col} is {len(v)} characters; the slip has room for {SLIP_TEXT_MAX[col]}")
    return vals, why, too_long

def import_csv(db: "PayrollDB | sqlite_utils.Database",
               path: str | os.PathLike[str], today: str | None = None) -> ImportResult:
    """Import employees and their salary lines from one CSV; all rows or none.

    Columns (header row required, any order, extra columns ignored): company_id,
    employee_id, name_en, name_bn, email, department, designation, bank_account, month,
    basic, house_rent, medical, conveyance, bonus, tax, provident_fund, loan.
    Amounts are taka with at most 2 decimals ("45000", "45000.50"), stored as poisha.
    Rules per row: every field non-empty but name_bn (OPTIONAL_COLUMNS); text no longer than the slip has room for
    (SLIP_TEXT_MAX: name_en, name_bn and designation 80, department 60 characters);
    employee_id is ``emp-`` + 1-12 digits; email like name@domain.tld with no dot first,
    last or twice in a row before the @; bank_account 8-20 digits; month YYYY-MM; amounts
    numeric, >= 0, deductions not above earnings; the company exists in the database;
    (employee_id, month) not repeated in the file; one employee's details the same on
    every row. Every problem is collected and an InputError lists ``line N: reason``
    (up to 50; ``.problems`` has all); on any problem nothing is written.
    Optional column ``left_on`` (OPTIONAL_CSV_COLUMNS): the day the employee left,
    YYYY-MM-DD, not after ``today`` (YYYY-MM-DD; default: today's date here), the same on
    every row of one employee; it marks them left with that date (a date already recorded
    is corrected), in the import's transaction. Empty: no change.
    Upsert: existing employees are updated (their ``active`` flag is kept unless
    ``left_on`` marks them), and so are existing salary lines for the same (employee, month).
    """
    d = _sdb(db)
    if today is None:
        from datetime import date

        today = date.today().isoformat()
    rows, problems, ignored = _read_csv(path, CSV_COLUMNS, OPTIONAL_CSV_COLUMNS)
    known_companies = {r[0] for r in d.execute("SELECT id FROM companies")}
    seen_line: dict[tuple[str, str], int] = {}
    left_seen: dict[str, tuple[int, str]] = {}  # employee -> (first line, its left_on: '' for none)
    emp_rows: dict[str, tuple[int, dict[str, Any]]] = {}
    lines: list[dict[str, Any]] = []
    for line, row in rows:
        vals, why, why_later = _required_fields(row, CSV_COLUMNS)
        if why:
            problems.extend((line, w) for w in why + why_later)
            continue
        why = why_later
        cid: int | None = None
        if not _INT_RE.fullmatch(vals["company_id"]):
            why.append(f"company_id {_show(vals['company_id'])} is not a company number")
        elif int(vals["company_id"]) not in known_companies:
            why.append(f"company_id {int(vals['company_id'])} does not exist "
                       f"(import companies first, or seed)")
        else:
            cid = int(vals["company_id"])
        emp = vals["employee_id"]
        if not _EMP_RE.fullmatch(emp):
            why.append(f"employee_id {_show(emp)} must be emp- and digits, like emp-00017")
        if len(vals["email"]) > 254 or not _EMAIL_RE.fullmatch(vals["email"]):
            why.append(f"email {_show(vals['email'])} is not a valid address")
        if not _BANK_RE.fullmatch(vals["bank_account"]):
            why.append("bank_account must be 8 to 20 digits")  # never echo the number
        month = vals["month"]
        if not _valid_month(month):
            why.append(f"month {_show(month)} is not a valid YYYY-MM month")
        amounts: dict[str, int] = {}
        for f in AMOUNT_FIELDS:
            try:
                amounts[f] = _parse_amount(vals[f])
            except ValueError as e:
                why.append(f"{f} {_amount_shape(vals[f])} (digits shown as 9) {e}")
        if len(amounts) == len(AMOUNT_FIELDS):
            earn = sum(amounts[f] for f in EARNINGS)
            ded = sum(amounts[f] for f in DEDUCTIONS)
            if ded > earn:  # (no figures: see _amount_shape)
                why.append(f"deductions ({', '.join(DEDUCTIONS)}) exceed earnings ({', '.join(EARNINGS)}): "
                           "the net pay would be negative")
        day, bad = _clean_text(row.get("left_on", ""))
        if day and (problem := bad or leaving_date_problem(day, today)):
            why.append(f"left_on {_show(day)}: {problem}")
        if not why:
            key = (emp, month)
            if key in seen_line:
                why.append(f"duplicate of line {seen_line[key]} ({emp}, {month})")
            else:
                seen_line[key] = line
            record = {"id": emp, "company_id": cid,
                      **{f: vals[f] for f in EMPLOYEE_FIELDS}}
            if emp in emp_rows and emp_rows[emp][1] != record:
                differ = [f for f in record if record[f] != emp_rows[emp][1].get(f)]
                why.append(f"{emp}'s details differ from line {emp_rows[emp][0]} ({', '.join(differ)}): "
                           "one employee's details must be the same on every row")
            emp_rows.setdefault(emp, (line, record))
            if emp in left_seen and left_seen[emp][1] != day:
                first = left_seen[emp]
                why.append(f"{emp}'s left_on differs from line {first[0]} ({first[1] or 'empty'} there, "
                           f"{day or 'empty'} here): one employee's leaving date is the same on every row")
            else:
                left_seen.setdefault(emp, (line, day))
        if why:
            problems.extend((line, w) for w in why)
            continue
        lines.append({"employee_id": emp, "month": month, "company_id": cid, **amounts})
    if problems:
        _fail(path, problems)
    employees = [rec for _, rec in emp_rows.values()]
    leaving = {emp: day for emp, (_, day) in left_seen.items() if day}
    with d.atomic():
        ids = [e["id"] for e in employees]
        cols = ["id", "company_id", *EMPLOYEE_FIELDS]
        before: dict[str, dict[str, Any]] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            for r in d.execute(f"SELECT {', '.join(cols)} FROM employees WHERE id IN ({','.join('?' * len(chunk))})",
                               chunk):
                before[r[0]] = dict(zip(cols, r))
        slips_before = _slip_rows(d, lines)
        lines_before = _line_rows(d, lines)
        d["employees"].upsert_all(employees, pk="id", batch_size=500)
        d["salary_lines"].upsert_all(lines, pk=("employee_id", "month"), batch_size=500)
        # (a line whose figures changed gets corrected_at from CORRECTED_AT_TRIGGER)
        marked: dict[str, str] = {}
        for emp, day in leaving.items():
            was = d.conn.execute("SELECT active, left_on FROM employees WHERE id = ?", (emp,)).fetchone()
            if was is not None and (was[0] != 0 or was[1] != day):
                # `active` first: LEFT_ON_TRIGGER clears the date when the mark changes
                d.conn.execute("UPDATE employees SET active = 0 WHERE id = ?", (emp,))
                d.conn.execute("UPDATE employees SET left_on = ? WHERE id = ?", (day, emp))
                marked[emp] = day
        slips_after = _slip_rows(d, [ln for ln in lines if (ln["employee_id"], ln["month"]) in slips_before])
    changed = sorted(e["id"] for e in employees if e["id"] in before and before[e["id"]] != e)
    moved = sorted((e["id"], before[e["id"]]["company_id"], e["company_id"]) for e in employees
                   if e["id"] in before and before[e["id"]]["company_id"] != e["company_id"])
    new_address = sorted(e["id"] for e in employees if e["id"] in before and before[e["id"]]["email"] != e["email"])
    changed_slips: dict[str, list[str]] = {}
    readdressed: dict[str, list[str]] = {}
    for (emp, month), row in sorted(slips_before.items()):
        after = slips_after.get((emp, month))
        if after is None or after == row:
            continue
        if after[:_SNAPSHOT_EMAIL] + after[_SNAPSHOT_EMAIL + 1:] == row[:_SNAPSHOT_EMAIL] + row[_SNAPSHOT_EMAIL + 1:]:
            readdressed.setdefault(month, []).append(emp)  # (only the address: the slip is the same)
        else:
            changed_slips.setdefault(month, []).append(emp)
    return ImportResult(companies=len({e["company_id"] for e in employees}),
                        employees=len(employees), salary_lines=len(lines), existing_employees=sorted(before),
                        months=sorted({ln["month"] for ln in lines}), employee_ids=sorted(ids),
                        changed_employees=changed, moved=moved, changed_slips=changed_slips, readdressed=readdressed,
                        new_address=new_address,
                        new_lines=sum((ln["employee_id"], ln["month"]) not in lines_before for ln in lines),
                        changed_lines=sum(lines_before.get((ln["employee_id"], ln["month"]), ln) != ln for ln in lines),
                        ignored_columns=ignored, left=marked,
                        after_leaving=sorted((ln["employee_id"], ln["month"]) for ln in lines
                                             if ln["employee_id"] in leaving
                                             and not in_month_run(False, leaving[ln["employee_id"]], ln["month"])))


def _line_rows(d: "sqlite_utils.Database", lines: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The salary lines in the database now of each (employee, month) of ``lines``, with
    the same keys as ``lines``' own (to compare), for those that have one."""
    cols = list(lines[0]) if lines else []
    by_month: dict[str, list[str]] = {}
    for ln in lines:
        by_month.setdefault(ln["month"], []).append(ln["employee_id"])
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for month, emps in by_month.items():
        for i in range(0, len(emps), 500):
            chunk = emps[i:i + 500]
            for r in d.conn.execute(f"SELECT {', '.join(cols)} FROM salary_lines WHERE month = ? AND employee_id IN "
                                    f"({','.join('?' * len(chunk))})", [month, *chunk]):
                row = dict(zip(cols, r))
                out[(row["employee_id"], row["month"])] = row
    return out


def _slip_rows(d: "sqlite_utils.Database", lines: list[dict[str, Any]]) -> dict[tuple[str, str], tuple]:
    """What the slip of each (employee, month) of ``lines`` reads from the database now
    (the snapshot query's row), for those that have one."""
    by_month: dict[str, list[str]] = {}
    for ln in lines:
        by_month.setdefault(ln["month"], []).append(ln["employee_id"])
    out: dict[tuple[str, str], tuple] = {}
    for month, emps in by_month.items():
        for i in range(0, len(emps), 500):
            chunk = emps[i:i + 500]
            for r in d.conn.execute(_SNAPSHOT_SQL + f" WHERE s.month = ? AND s.employee_id IN "
                                                    f"({','.join('?' * len(chunk))})", [month, *chunk]):
                out[(r[1], r[0])] = tuple(r[:_SNAPSHOT_DATA])
    return out


def import_companies_csv(db: "PayrollDB | sqlite_utils.Database",
                         path: str | os.PathLike[str], months: tuple[str, ...] = ()) -> ImportResult:
    """Import companies from a CSV with columns id, name, address; all rows or none.

    id is a positive integer, name (at most 80 characters) and address (160) non-empty,
    no id twice in the file.
    Existing companies with the same id are updated. With ``months`` (already run: a typo
    in a company's name found after its run), the name and address kept for each of those
    months (``keep_company_details``) are replaced too, in the same transaction, so their
    resends print the corrected ones; a month not run keeps nothing and needs no correction.
    """
    for m in months:
        _check_month(m)
    d = _sdb(db)
    rows, problems, _ = _read_csv(path, COMPANY_CSV_COLUMNS)
    seen: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    for line, row in rows:
        vals, why, why_later = _required_fields(row, COMPANY_CSV_COLUMNS)
        why += why_later
        if not why:
            if not _INT_RE.fullmatch(vals["id"]) or int(vals["id"]) < 1:
                why.append(f"id {_show(vals['id'])} must be a positive whole number")
            elif int(vals["id"]) in seen:
                why.append(f"duplicate of line {seen[int(vals['id'])]} (id {int(vals['id'])})")
            else:
                seen[int(vals["id"])] = line
        if why:
            problems.extend((line, w) for w in why)
            continue
        out.append({"id": int(vals["id"]), "name": vals["name"], "address": vals["address"]})
    if problems:
        _fail(path, problems)
    with d.atomic():
        before = {r["id"]: (r["name"], r["address"]) for r in d["companies"].rows} if out else {}
        d["companies"].upsert_all(out, pk="id", batch_size=500)
        corrected: dict[str, list[int]] = {}
        for m in dict.fromkeys(months):
            for r in out:
                cur = d.conn.execute("UPDATE company_months SET name = ?, address = ? WHERE month = ? AND "
                                     "company_id = ? AND (name != ? OR address != ?)",
                                     [r["name"], r["address"], m, r["id"], r["name"], r["address"]])
                if cur.rowcount:
                    corrected.setdefault(m, []).append(r["id"])
    updated = [r["id"] for r in out if r["id"] in before and before[r["id"]] != (r["name"], r["address"])]
    same = sum(1 for r in out if before.get(r["id"]) == (r["name"], r["address"]))
    return ImportResult(companies=len(out), updated=updated, unchanged=same, kept_months=months_kept(d, updated),
                        corrected=corrected)


# ---------------------------------------------------------------------------
# Snapshots and queries
# ---------------------------------------------------------------------------

def mask_account(number: str) -> str:
    """'1234567894821' -> '•••• 4821'."""
    return MASK + number[-4:]


def in_month_run(active: bool, left_on: str | None, month: str) -> bool:
    """Whether an employee with a salary line for ``month`` gets a slip in its run: one who
    works here, or who left (`payrun employee left`) on or after the month's first day
    (they worked in it: their final slip). One who left before the month, or whose
    leaving date is not recorded (marked before dates were kept, or by an earlier version),
    is left out. ``IN_MONTH_RUN`` is the same rule in SQL."""
    return bool(active) or (left_on or "") >= f"{month}-01"


def in_month_run_sql(month_sql: str) -> str:
    """``in_month_run`` over ``employees e`` as SQL, ``month_sql`` the month's expression
    (``s.month``, or ``?``). A NULL date compares as '' (before every month): a bare
    ``e.left_on >= …`` is NULL there, and a NOT of it drops the row."""
    return f"(e.active = 1 OR COALESCE(e.left_on, '') >= ({month_sql} || '-01'))"


IN_MONTH_RUN = in_month_run_sql("s.month")


LINE_COMPANY = "s.company_id"
"""The company that paid a salary line: its own ``company_id`` (set by the import, the
seed and ensure_month: an employee who moved in February still has November's slip from
November's employer; lines from before it got the employee's company when the column
was added). Indexed with the month: the fan-out reads one company's lines at a time."""

_SNAPSHOT_SQL = f"""
SELECT s.month, e.id, e.name_en, e.name_bn, e.email, e.department, e.designation,
       e.bank_account, c.id, COALESCE(m.name, c.name), COALESCE(m.address, c.address),
       s.basic, s.house_rent, s.medical, s.conveyance, s.bonus,
       s.tax, s.provident_fund, s.loan, CASE WHEN e.active = 0 THEN e.left_on END
FROM salary_lines s
JOIN employees e ON e.id = s.employee_id
JOIN companies c ON c.id = {LINE_COMPANY}
LEFT JOIN company_months m ON m.month = s.month AND m.company_id = {LINE_COMPANY}
"""
"""The company's name and address are those it had when its month was run
(``keep_company_details``); a month run before payrun kept them reads today's."""
_SNAPSHOT_EMAIL = 4
"""The email's column in ``_SNAPSHOT_SQL``'s rows (the one field the slip does not print)."""
_SNAPSHOT_DATA = 19
"""``_SNAPSHOT_SQL``'s columns of the employee's data and figures (the leaving date after
them marks a final slip; an import that only marks a leaver changes no slip made)."""


def keep_company_details(db: "PayrollDB | sqlite_utils.Database", month: str, company_id: int) -> None:
    """Record the company's name and address for ``month`` as they are now, unless already
    recorded: called as the month's run of the company starts, so every slip of that month
    (a resend, a retry, a top-up for an employee added later) reads what the run printed,
    not a rename imported afterwards."""
    d = _sdb(db)
    with d.atomic():
        d.conn.execute("INSERT OR IGNORE INTO company_months (month, company_id, name, address) "
                       "SELECT ?, id, name, address FROM companies WHERE id = ?", [month, company_id])


def months_kept(db: "PayrollDB | sqlite_utils.Database", company_ids: list[int]) -> dict[int, list[str]]:
    """company id -> the months whose name and address are kept for it (months run)."""
    out: dict[int, list[str]] = {}
    if not company_ids:
        return out
    for cid, month in _sdb(db).conn.execute(
            f"SELECT company_id, month FROM company_months WHERE company_id IN ({','.join('?' * len(company_ids))}) "
            "ORDER BY company_id, month", list(company_ids)):
        out.setdefault(cid, []).append(month)
    return out


def _snapshot(r: tuple) -> dict[str, Any]:
    """A ``_SNAPSHOT_SQL`` row as a slip's snapshot; a leaver's slip of the month they left
    in has ``final``: the day they left (the slip says it is their final one)."""
    (month, emp_id, name_en, name_bn, email, dept, desig, bank, cid, cname, caddr,
     basic, house_rent, medical, conveyance, bonus, tax, pf, loan, left) = r
    snap = {
        "month": month,
        "key": keys.idem_key(month, emp_id),
        "company": {"id": cid, "name": cname, "address": caddr},
        "employee": {
            "id": emp_id, "name_en": name_en, "name_bn": name_bn, "email": email,
            "department": dept, "designation": desig, "bank_account": mask_account(bank),
        },
        "earnings": {"basic": basic, "house_rent": house_rent, "medical": medical,
                     "conveyance": conveyance, "bonus": bonus},
        "deductions": {"tax": tax, "provident_fund": pf, "loan": loan},
    }
    if left and left[:7] == month:  # (only for a leaver's slip of the month they left in)
        snap["final"] = left
    return snap


def snapshots(db: "PayrollDB | sqlite_utils.Database", month: str,
              company_id: int | None = None) -> Iterator[dict[str, Any]]:
    """Slip snapshots for ``month``: the employees with a salary line that month whom its
    run pays (``in_month_run``: those working here, and leavers who left in it or later),
    ordered by company id then employee id; one joined query, rows streamed."""
    _check_month(month)
    sql = _SNAPSHOT_SQL + f" WHERE s.month = ? AND {IN_MONTH_RUN}"
    params: list[Any] = [month]
    if company_id is not None:
        sql += f" AND {LINE_COMPANY} = ?"
        params.append(company_id)
    sql += " ORDER BY s.company_id, s.employee_id"
    for r in _sdb(db).conn.execute(sql, params):
        yield _snapshot(r)


def employee_snapshot(db: "PayrollDB | sqlite_utils.Database", month: str,
                      employee_id: str) -> dict[str, Any]:
    """One snapshot for a one-off resend. Inactive employees are included (a resend is
    an explicit request). Raises InputError naming what is missing."""
    _check_month(month)
    d = _sdb(db)
    r = d.conn.execute(_SNAPSHOT_SQL + " WHERE s.month = ? AND s.employee_id = ?",
                       [month, employee_id]).fetchone()
    if r is not None:
        return _snapshot(r)
    if d.conn.execute("SELECT 1 FROM employees WHERE id = ?", [employee_id]).fetchone():
        raise InputError(f"employee {employee_id} has no salary line for {month}")
    raise InputError(f"no employee {employee_id!r} in the payroll database")


def corrected_at(db: "PayrollDB | sqlite_utils.Database", month: str, employee_id: str) -> str | None:
    """When an import last changed the figures of this salary line (UTC ISO), else None."""
    row = _sdb(db).conn.execute("SELECT corrected_at FROM salary_lines WHERE employee_id = ? AND month = ?",
                                (employee_id, month)).fetchone()
    return row[0] if row else None


def is_active(db: "PayrollDB | sqlite_utils.Database", employee_id: str) -> bool | None:
    """Whether ``employee_id`` works here (not marked `payrun employee left`); None if unknown."""
    row = _sdb(db).conn.execute("SELECT active FROM employees WHERE id = ?", (employee_id,)).fetchone()
    return None if row is None else bool(row[0])


def left_on(db: "PayrollDB | sqlite_utils.Database", employee_ids: list[str]) -> dict[str, str | None]:
    """employee id -> the leaving date recorded (None: marked before dates were kept), of
    those of ``employee_ids`` marked left."""
    out: dict[str, str | None] = {}
    for i in range(0, len(employee_ids), 500):
        part = employee_ids[i:i + 500]
        out.update(_sdb(db).conn.execute(
            f"SELECT id, left_on FROM employees WHERE active = 0 AND id IN ({','.join('?' * len(part))})",
            part).fetchall())
    return out


def left_out_text(n: int, month: str) -> str:
    """How `payrun check` and `payrun seed` count the employees with a salary line for
    ``month`` whom its run leaves out (``leavers_with_salary_line``'s unpaid)."""
    return (f"{n:,} employee{'' if n == 1 else 's'} with salary lines left out (left before {month} or on a day "
            "not recorded)")


def left_label(date: str | None) -> str:
    """How a leaver is named beside their id: ``left 2026-10-20``, or without a date."""
    return f"left {date}" if date else "left, date not recorded"


def set_active(db: "PayrollDB | sqlite_utils.Database", employee_ids: list[str], active: bool,
               left_date: str | None = None, redate: bool = True) -> list[str]:
    """Mark employees as working here (1) or gone (0): a pay run, its "no slip yet" count
    and `payrun remind` leave out those gone; a resend (HR's explicit request) still
    works. ``left_date`` (YYYY-MM-DD): the day they left, recorded with the mark (and set
    on those already marked left, a date corrected, unless not ``redate``: theirs is kept),
    in the same transaction as the mark; marking one back clears it. All ids
    must exist (InputError naming the unknown, nothing changed). Returns the ids whose
    flag changed."""
    d = _sdb(db)
    ids = list(dict.fromkeys(employee_ids))
    known = {r[0]: r[1] for r in d.conn.execute(
        f"SELECT id, active FROM employees WHERE id IN ({','.join('?' * len(ids))})", ids)} if ids else {}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise InputError(f"no employee {', '.join(map(repr, unknown[:10]))}{' …' if len(unknown) > 10 else ''} "
                         "in the payroll database; nothing changed")
    changed = [i for i in ids if bool(known[i]) != active]
    with d.atomic():
        d.conn.executemany("UPDATE employees SET active = ? WHERE id = ?", [(int(active), i) for i in changed])
        if active:
            d.conn.executemany("UPDATE employees SET left_on = NULL WHERE id = ?", [(i,) for i in changed])
        elif left_date is not None:
            d.conn.executemany("UPDATE employees SET left_on = ? WHERE id = ?",
                               [(left_date, i) for i in (ids if redate else changed)])
    return changed


def companies(db: "PayrollDB | sqlite_utils.Database") -> list[dict[str, Any]]:
    """Every company as {id, name, address}, by id."""
    return [{"id": i, "name": n, "address": a} for i, n, a in
            _sdb(db).conn.execute("SELECT id, name, address FROM companies ORDER BY id")]


def _scope(month: str, company_id: int | None) -> tuple[str, list[Any]]:
    _check_month(month)
    where = ("FROM salary_lines s JOIN employees e ON e.id = s.employee_id "
             f"WHERE s.month = ? AND {IN_MONTH_RUN}")
    params: list[Any] = [month]
    if company_id is not None:
        where += f" AND {LINE_COMPANY} = ?"
        params.append(company_id)
    return where, params


def company_ids_for(db: "PayrollDB | sqlite_utils.Database", month: str,
                    company_id: int | None = None) -> list[int]:
    """Companies having salary lines in ``month`` that its run pays (``in_month_run``), ascending."""
    where, params = _scope(month, company_id)
    return [r[0] for r in _sdb(db).conn.execute(
        f"SELECT DISTINCT {LINE_COMPANY} AS cid {where} ORDER BY cid", params)]


def employee_ids(db: "PayrollDB | sqlite_utils.Database", month: str, company_id: int | None = None) -> set[str]:
    """The ids of the employees ``snapshots(db, month, company_id)`` yields."""
    where, params = _scope(month, company_id)
    return {r[0] for r in _sdb(db).conn.execute(f"SELECT e.id {where}", params)}


def employee_ids_by_company(db: "PayrollDB | sqlite_utils.Database", month: str) -> dict[int, set[str]]:
    """``employee_ids`` of every company at once (one query, not one per company)."""
    where, params = _scope(month, None)
    out: dict[int, set[str]] = {}
    for cid, emp in _sdb(db).conn.execute(f"SELECT {LINE_COMPANY}, e.id {where}", params):
        out.setdefault(cid, set()).add(emp)
    return out


def without_salary_line(db: "PayrollDB | sqlite_utils.Database", month: str,
                        company_ids: list[int], with_slip: set[str] = frozenset()) -> dict[int, list[str]]:
    """Per company of ``company_ids``, the employees (by their company now) whom ``month``'s
    run would pay (``in_month_run``: working here, or left on or after its first day) with
    no salary line for it at all, ids ascending: a pay run makes them no slip, and "all
    delivered" must not hide them from HR (a line the import never got, a leaver's final
    salary, or a person unpaid this month). Those who left before the month (or on a day
    not recorded) are not counted, nor those in ``with_slip`` (a slip job of the month:
    their line was removed after the run), nor those whose first salary line is of a later
    month (hired since: December's hires are not missing from November)."""
    _check_month(month)
    if not company_ids:
        return {}
    marks = ",".join("?" * len(company_ids))
    return _by_company(_sdb(db).conn.execute(
        f"SELECT e.company_id, e.id FROM employees e WHERE {in_month_run_sql('?')} AND e.company_id IN ({marks}) "
        "AND NOT EXISTS (SELECT 1 FROM salary_lines s WHERE s.employee_id = e.id AND s.month = ?) "
        "AND COALESCE((SELECT MIN(s.month) FROM salary_lines s WHERE s.employee_id = e.id), '') < ? "
        "ORDER BY e.company_id, e.id", [month, *company_ids, month, month]), with_slip)


def with_leaving_dates(db: "PayrollDB | sqlite_utils.Database", ids: list[str]) -> list[str]:
    """``ids`` as a note names them: a leaver with the day they left (``emp-5 (left
    2026-11-20)``), anyone else bare."""
    dates = left_on(db, list(ids))
    return [f"{e} ({left_label(dates[e])})" if e in dates else e for e in ids]


def _by_company(rows, with_slip: set[str]) -> dict[int, list[str]]:
    """(company id, employee id) rows as {company: [employee, …]}, less ``with_slip``."""
    out: dict[int, list[str]] = {}
    for cid, emp in rows:
        if emp not in with_slip:
            out.setdefault(cid, []).append(emp)
    return out


def left_with_salary_line(db: "PayrollDB | sqlite_utils.Database", month: str,
                          company_ids: list[int], with_slip: set[str] = frozenset()) -> dict[int, list[str]]:
    """Per company of ``company_ids`` (the company of the salary line), the employees marked
    left (`payrun employee left`) who have a salary line for ``month`` that its run leaves
    out (``in_month_run``: they left before the month, or on a day not recorded) and no
    slip job of it (``with_slip``), ids ascending. A leaver who left in the month or later
    is paid by its run (their final slip) and not named here."""
    _check_month(month)
    if not company_ids:
        return {}
    marks = ",".join("?" * len(company_ids))
    return _by_company(_sdb(db).conn.execute(
        f"SELECT {LINE_COMPANY} AS cid, e.id FROM salary_lines s JOIN employees e ON e.id = s.employee_id "
        f"WHERE s.month = ? AND e.active = 0 AND NOT {IN_MONTH_RUN} AND {LINE_COMPANY} IN ({marks}) "
        "ORDER BY cid, e.id", [month, *company_ids]), with_slip)


def leavers_with_salary_line(db: "PayrollDB | sqlite_utils.Database", month: str) -> list[tuple[str, str | None, bool]]:
    """Every employee marked left with a salary line for ``month``, by id: (id, the day they
    left or None, whether the month's run pays them: ``in_month_run``, their final slip).
    `payrun check` names them before the run."""
    _check_month(month)
    return [(e, day, bool(paid)) for e, day, paid in _sdb(db).conn.execute(
        f"SELECT e.id, e.left_on, {IN_MONTH_RUN} FROM salary_lines s JOIN employees e ON e.id = s.employee_id "
        "WHERE s.month = ? AND e.active = 0 ORDER BY e.id", [month])]


def left_text(left: dict[int, list[str]], month: str, dates: dict[str, str | None] | None = None) -> str | None:
    """The note for ``left_with_salary_line``'s answer (None when there are none): who, with
    the day each left (``dates``, from ``left_on``), why the run left them out, and how to
    make their slip if they worked that month: their leaving date recorded (or corrected)
    with `--on`, then `run --resume` (no `employee back`, which clears the date)."""
    ids = [e for cid in sorted(left) for e in left[cid]]
    if not ids:
        return None
    n = len(ids)
    named = [f"{e} ({left_label(dates.get(e))})" if dates is not None else e for e in ids[:10]]
    shown = " ".join(named) + (f" … ({n - 10:,} more)" if n > 10 else "")
    one = n == 1
    who = " ".join(ids) if n <= 10 else "ID…"
    return (f"{n:,} employee{'' if one else 's'} marked as left (`payrun employee left`) "
            f"{'has' if one else 'have'} a salary line for {month} and no slip of it: {shown}. A run of {month} "
            f"pays leavers who left on or after {month}-01 (their final slip); {'this one' if one else 'these'} left "
            f"before {month}, or on a day not recorded. Worked in {month}: `payrun employee left {who} --on DATE` "
            f"(the day they left), then `payrun run --month {month} --resume`")


def left_out_of_month(db: "PayrollDB | sqlite_utils.Database", employee_id: str, month: str) -> str | None:
    """Why ``employee_id`` has no slip of ``month`` when it is because they are marked left
    before it (or on a day not recorded) and have a salary line for it (``in_month_run``),
    with the way to make theirs; else None. `payrun job` of such a slip's job (drill 43:
    HR asking about a leaver was told "no job … ids look like …", as for a typo). The
    caller knows the month was run."""
    _check_month(month)
    row = _sdb(db).conn.execute(
        "SELECT e.active, e.left_on FROM employees e JOIN salary_lines s ON s.employee_id = e.id "
        "WHERE e.id = ? AND s.month = ?", (employee_id, month)).fetchone()
    if row is None or in_month_run(bool(row[0]), row[1], month):
        return None
    return (f"no {month} slip was made for {employee_id}: they are marked as left ({left_label(row[1])}), before "
            f"{month} or on a day not recorded, so the {month} run left them out; worked in {month}: `payrun "
            f"employee left {employee_id} --on DATE` (the day they left, {month}-01 or later), then `payrun run "
            f"--month {month} --resume`")


def final_missing_text(ids: list[str], month: str, dates: dict[str, str | None], companies: list[int]) -> str | None:
    """The note on leavers whom a run of ``month`` pays (``in_month_run``: they left on
    or after its first day, ``dates``) and whose company's run (``companies``) made them no
    slip (None when there are none). Not "added after the run", which they were not
    (session 43): the run was made by an earlier version, which paid only those working
    here, or before their leaving day was recorded (marked left with no day, or
    an earlier one, and dated in the month since: `employee left --on`, an import's
    left_on); or their salary line was imported after it. `run --resume` makes their slip
    (the final one of a leaver of ``month``)."""
    if not ids:
        return None
    n = len(ids)
    one = n == 1
    shown = " ".join(f"{e} ({left_label(dates.get(e))})" for e in ids[:10]) + (f" … ({n - 10:,} more)" if n > 10
                                                                                 else "")
    return (f"{n:,} employee{'' if one else 's'} of {'company' if len(companies) == 1 else 'companies'} "
            f"{', '.join(map(str, companies))} who left in {month} or later {'has' if one else 'have'} a salary "
            f"line for {month} and no slip: {shown}. A run of {month} pays those who left on or after {month}-01, "
            f"but {'its' if len(companies) == 1 else 'the'} run left {'this one' if one else 'them'} out: it was "
            f"made by an earlier payrun version (which paid only those working here), or before the day they left "
            f"was recorded (`payrun employee left --on`, an import's left_on), or before their salary line was "
            f"imported: `payrun run --month {month} --resume` makes {'the slip' if one else 'their slips'}")


def left_again(ids: list[str], dates: dict[str, str | None]) -> str:
    """The `payrun employee left` that marks ``ids`` left again after an `employee back`
    (which clears the date), each with the day they left (``dates``): said bare, as the
    notes did, it recorded today, and HR following them lost every leaver's real date."""
    if len(ids) > 10:
        return "`payrun employee left ID… --on DATE` again, each with the day they left (shown above)"
    by_day: dict[str | None, list[str]] = {}
    for e in ids:
        by_day.setdefault(dates.get(e), []).append(e)
    cmds = [f"`payrun employee left {' '.join(es)}" + (f" --on {day}" if day else "") + "`"
            for day, es in sorted(by_day.items(), key=lambda kv: kv[0] or "")]
    return (" and ".join(cmds) + " again"
            + (" (the day they left is not recorded: add `--on` the day)" if None in by_day else ""))


def emails(db: "PayrollDB | sqlite_utils.Database", employee_ids: list[str]) -> dict[str, str]:
    """employee id -> email address now, of those of ``employee_ids`` that exist."""
    out: dict[str, str] = {}
    for i in range(0, len(employee_ids), 500):
        part = employee_ids[i:i + 500]
        out.update(_sdb(db).conn.execute(
            f"SELECT id, email FROM employees WHERE id IN ({','.join('?' * len(part))})", part).fetchall())
    return out


def count_employees(db: "PayrollDB | sqlite_utils.Database", month: str,
                    company_id: int | None = None) -> int:
    """How many snapshots ``snapshots(db, month, company_id)`` yields."""
    where, params = _scope(month, company_id)
    return _sdb(db).conn.execute(f"SELECT count(*) {where}", params).fetchone()[0]

