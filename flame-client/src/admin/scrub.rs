//! `flame-admin scrub [VOLUME | pg ID] [--dry-run]` and `flame-admin pg compare
//! [VOLUME | pg ID]`: ask the primary of each placement group concerned to compare
//! its acting copies block by block (and, for scrub, repair the minority), then
//! print what they found.

use super::{AdminError, Cli, Result, json};
use crate::{ClientConfig, Cluster, MgrClient};
use flame_common::ids::PgId;
use flame_common::protocol::ScrubCounts;
use flame_common::reactor::{Reactor, ReactorConfig};
use serde::Serialize;

/// What to scrub: every group, a volume's groups, or one group.
#[derive(clap::Args, Debug)]
pub struct ScrubArgs {
    /// Nothing: every placement group; `VOLUME`: the groups of that volume;
    /// `pg ID`: one group.
    #[arg(num_args = 0..=2)]
    pub what: Vec<String>,
    /// Compare only; change nothing (exit status 1 if any copies differ).
    #[arg(long)]
    pub dry_run: bool,
}

/// One group's result.
#[derive(Serialize)]
struct PgResult {
    pg: u32,
    objects_checked: u64,
    inconsistent: u64,
    repaired: u64,
    primary_won: u64,
    errors: u64,
}

#[derive(Serialize)]
struct ScrubReport {
    dry_run: bool,
    consistent: bool,
    pgs: Vec<PgResult>,
    objects_checked: u64,
    inconsistent: u64,
    repaired: u64,
    primary_won: u64,
    errors: u64,
}

fn pgs_of(cluster: &Cluster, mgr: &MgrClient, what: &[String]) -> Result<Vec<PgId>> {
    let pg_count = cluster.map().pool.pg_count;
    match what {
        [] => Ok((0..pg_count).map(PgId).collect()),
        [kw, id] if kw == "pg" => {
            let n: u32 = id
                .parse()
                .map_err(|_| AdminError(format!("`{id}` is not a placement group number")))?;
            if n >= pg_count {
                return Err(AdminError(format!(
                    "placement group {n} does not exist (the pool has {pg_count})"
                )));
            }
            Ok(vec![PgId(n)])
        }
        [volume] => {
            let v = mgr.volume(volume)?;
            Ok(cluster.volume_pgs(v.id, v.size))
        }
        _ => Err(AdminError(
            "expected nothing, a volume name, or `pg ID`".into(),
        )),
    }
}

/// Runs a scrub (or, with `dry_run`, a comparison) and renders its report. A
/// comparison that finds differing copies, or a scrub that could not check or
/// repair everything, is an error (exit status 1) whose message is the report.
pub fn run(cli: &Cli, mgr: &MgrClient, args: &ScrubArgs) -> Result<String> {
    let cluster = Cluster::connect(ClientConfig {
        io_timeout_ms: 0,
        ..super::admin_client_config(cli)
    })?;
    let pgs = pgs_of(&cluster, mgr, &args.what)?;
    let mut reactor = Reactor::new(ReactorConfig::default())
        .map_err(|e| AdminError(format!("starting the I/O reactor: {e}")))?;
    let dry_run = args.dry_run;
    let c = cluster.clone();
    let results: Vec<(PgId, std::result::Result<ScrubCounts, String>)> = reactor
        .block_on(async move {
            let mut out = Vec::with_capacity(pgs.len());
            for pg in pgs {
                let r = c.scrub_pg(pg, dry_run).await.map_err(|e| e.to_string());
                out.push((pg, r));
            }
            out
        })
        .map_err(|e| AdminError(format!("I/O reactor failed: {e}")))?;
    let mut total = ScrubCounts::default();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for (pg, r) in results {
        match r {
            Ok(c) => {
                total.add(&c);
                rows.push(PgResult {
                    pg: pg.0,
                    objects_checked: c.objects_checked,
                    inconsistent: c.inconsistent,
                    repaired: c.repaired,
                    primary_won: c.primary_won,
                    errors: c.errors,
                });
            }
            Err(e) => failures.push(format!("{pg}: {e}")),
        }
    }
    let consistent = total.inconsistent == 0 && total.errors == 0 && failures.is_empty();
    let report = ScrubReport {
        dry_run,
        consistent,
        pgs: rows,
        objects_checked: total.objects_checked,
        inconsistent: total.inconsistent,
        repaired: total.repaired,
        primary_won: total.primary_won,
        errors: total.errors + failures.len() as u64,
    };
    let text = if cli.json {
        json(&report)?
    } else {
        render(&report, &failures)
    };
    let failed = !failures.is_empty()
        || total.errors > 0
        || (dry_run && total.inconsistent > 0)
        || (!dry_run && total.repaired < total.inconsistent);
    if failed {
        return Err(AdminError(text.trim_end().to_string()));
    }
    Ok(text)
}

fn render(r: &ScrubReport, failures: &[String]) -> String {
    let mut s = String::new();
    for p in &r.pgs {
        if p.inconsistent == 0 && p.errors == 0 {
            continue;
        }
        s.push_str(&format!(
            "pg {}: {} objects, {} inconsistent, {} repaired{}{}\n",
            p.pg,
            p.objects_checked,
            p.inconsistent,
            p.repaired,
            if p.primary_won > 0 {
                format!(
                    ", {} with no majority (the primary's copy won)",
                    p.primary_won
                )
            } else {
                String::new()
            },
            if p.errors > 0 {
                format!(", {} could not be checked", p.errors)
            } else {
                String::new()
            },
        ));
    }
    for f in failures {
        s.push_str(&format!("failed: {f}\n"));
    }
    let verb = if r.dry_run { "compared" } else { "scrubbed" };
    s.push_str(&format!(
        "{verb} {} placement groups, {} objects: {}\n",
        r.pgs.len(),
        r.objects_checked,
        if r.consistent {
            "all copies agree".to_string()
        } else if r.dry_run {
            format!("{} objects differ between copies", r.inconsistent)
        } else {
            format!(
                "{} inconsistent, {} repaired, {} errors",
                r.inconsistent, r.repaired, r.errors
            )
        }
    ));
    s
}
