//! `reservation add|list|delete`: IP reservations (Calico's `IPReservation`), addresses that
//! auto-assign never hands out.

use blockipam_store::DatastoreSettings;
use ipam_core::reservations::{parse_reserved_cidr, validate_reservation, Reservation};
use serde::Serialize;

use super::pool::invalid_text;
use super::{open_ipam, to_json};
use crate::cli::{ReservationAddArgs, ReservationDeleteArgs};
use crate::error::CtlError;
use crate::output::{Outcome, Table};
use crate::settings::OpenMode;

/// One reservation as JSON: `{name, cidrs}` (Calico: `metadata.name`, `spec.reservedCIDRs`), and
/// `error` for one that cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReservationJson {
    /// Its name.
    pub name: String,
    /// The reserved CIDRs, single addresses as /32 or /128.
    pub cidrs: Vec<String>,
    /// Why the stored reservation cannot be read (then `cidrs` is empty): `check` reports it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl From<&Reservation> for ReservationJson {
    fn from(reservation: &Reservation) -> Self {
        ReservationJson {
            name: reservation.name.clone(),
            cidrs: reservation.cidrs.iter().map(|c| c.to_string()).collect(),
            error: None,
        }
    }
}

/// What `reservation list` shows of a reservation that cannot be decoded.
const UNDECODABLE_RESERVATION: &str =
    "cannot be decoded: auto-assign fails until it is deleted or restored (see `blockipamctl check`)";

/// `reservation add NAME CIDR|IP...`: validates before touching the store (a malformed address,
/// a CIDR with host bits or a bad name is a usage error), then creates the reservation.
///
/// # Errors
/// [`CtlError::Usage`] for invalid input; [`CtlError::Failed`] when the name is taken or the store
/// is in trouble.
pub async fn add(
    settings: &DatastoreSettings,
    args: &ReservationAddArgs,
) -> Result<Outcome, CtlError> {
    let cidrs = args
        .cidrs
        .iter()
        .map(|text| parse_reserved_cidr(text))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let reservation = Reservation {
        name: args.name.clone(),
        cidrs,
    };
    validate_reservation(&reservation).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    ipam.add_reservation(&reservation).await?;
    let json = ReservationJson::from(&reservation);
    let table = format!(
        "Created IP reservation {}: {}.\n",
        json.name,
        json.cidrs.join(", ")
    );
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// `reservation list`: every reservation, one that cannot be decoded included (named, with what is
/// wrong).
///
/// # Errors
/// Store trouble.
pub async fn list(settings: &DatastoreSettings) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let json: Vec<ReservationJson> = ipam
        .list_reservations_each()
        .await?
        .into_iter()
        .map(|(name, reservation)| match reservation {
            Ok(reservation) => ReservationJson::from(&reservation),
            Err(e) => ReservationJson {
                name,
                cidrs: Vec::new(),
                error: Some(e.to_string()),
            },
        })
        .collect();
    let table = if json.is_empty() {
        "No IP reservations. Create one with: blockipamctl reservation add <NAME> <CIDR|IP>...\n"
            .to_owned()
    } else {
        let mut table = Table::new(&["NAME", "CIDRS"]);
        for row in &json {
            let cidrs = if row.error.is_some() {
                UNDECODABLE_RESERVATION.to_owned()
            } else {
                row.cidrs.join(",")
            };
            table.row(vec![row.name.clone(), cidrs]);
        }
        table.render()
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// `reservation delete NAME`.
///
/// # Errors
/// [`CtlError::Usage`] for an invalid name; [`CtlError::Failed`] for an unknown reservation or
/// store trouble.
pub async fn delete(
    settings: &DatastoreSettings,
    args: &ReservationDeleteArgs,
) -> Result<Outcome, CtlError> {
    ipam_core::reservations::validate_reservation_name(&args.name)
        .map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let deleted = ipam.delete_reservation(&args.name).await?;
    let json = ReservationJson::from(&deleted);
    let table = format!(
        "Deleted IP reservation {}; its addresses may be auto-assigned again.\n",
        json.name
    );
    Ok(Outcome::ok(to_json(&json)?, table))
}
