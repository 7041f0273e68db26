//! A small `strftime` for the `strftime_now` template global (Llama 3 templates print today's
//! date with it). Time is UTC; the common directives are supported, others are kept verbatim.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tm {
    pub year: i64,
    pub month: u32, // 1..=12
    pub day: u32,   // 1..=31
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    pub weekday: u32, // 0 = Sunday
    pub yearday: u32, // 1..=366
}

pub(crate) fn now_utc() -> Tm {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    from_unix(secs)
}

pub(crate) fn from_unix(secs: i64) -> Tm {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400) as u32;
    let (year, month, day) = civil_from_days(days);
    let jan1 = days_from_civil(year, 1, 1);
    Tm {
        year,
        month,
        day,
        hour: rem / 3600,
        minute: rem / 60 % 60,
        second: rem % 60,
        weekday: (days + 4).rem_euclid(7) as u32, // 1970-01-01 was a Thursday
        yearday: (days - jan1 + 1) as u32,
    }
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 -> (year, month, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Formats `tm` with C/Python strftime directives; `%-d` style drops zero padding (glibc).
pub(crate) fn format(tm: &Tm, fmt: &str) -> String {
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |v: u32, width: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        let hour12 = match tm.hour % 12 {
            0 => 12,
            h => h,
        };
        match spec {
            Some('Y') => out.push_str(&tm.year.to_string()),
            Some('y') => out.push_str(&num(tm.year.rem_euclid(100) as u32, 2)),
            Some('m') => out.push_str(&num(tm.month, 2)),
            Some('d') => out.push_str(&num(tm.day, 2)),
            Some('e') => out.push_str(&format!("{:2}", tm.day)),
            Some('H') => out.push_str(&num(tm.hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(tm.minute, 2)),
            Some('S') => out.push_str(&num(tm.second, 2)),
            Some('j') => out.push_str(&num(tm.yearday, 3)),
            Some('p') => out.push_str(if tm.hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[tm.month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[tm.month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[tm.weekday as usize]),
            Some('a') => out.push_str(&DAYS[tm.weekday as usize][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let tm = from_unix(1_709_211_909);
        assert_eq!(format(&tm, "%Y-%m-%d %H:%M:%S"), "2024-02-29 13:05:09");
        assert_eq!(format(&tm, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            format(&tm, "%A %B %-d, %I %p, day %j"),
            "Thursday February 29, 01 PM, day 060"
        );
        assert_eq!(format(&from_unix(0), "%a %d %b %Y"), "Thu 01 Jan 1970");
    }
}
